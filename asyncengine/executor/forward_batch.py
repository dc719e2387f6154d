"""ForwardBatch: a BatchPlan turned into the flat tensors of one forward, built once per plan."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from asyncengine.common.plan import BatchPlan


@dataclass(slots=True)
class ForwardBatch:
    """Tokens are ordered extend segments first (ragged, by ``extend_cu_seqlens_q``), then one
    token per decode segment. Block tables are page-table rows cut to the group's longest
    sequence. Python ints beside the tensors save backends a device sync.
    """

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64
    sample_indices: torch.Tensor  # [num_sampled] int64: rows of the flat tokens to sample after
    page_size: int
    num_extend_tokens: int
    extend_block_table: torch.Tensor  # [Be, Pe] int32
    extend_seq_lens: torch.Tensor  # [Be] int32, kv length incl. the new tokens
    extend_cu_seqlens_q: torch.Tensor  # [Be + 1] int32
    extend_max_q_len: int
    extend_max_seq_len: int
    decode_block_table: torch.Tensor  # [Bd, Pd] int32
    decode_seq_lens: torch.Tensor  # [Bd] int32, kv length incl. the new token
    decode_max_seq_len: int
    # rows of the flat tokens whose logits score prompt tokens (Segment.scoring), plan order
    score_indices: torch.Tensor | None = None
    # (source, destination) [C] int64 KV slots each layer copies after storing, before
    # attending (BatchPlan.kv_copies)
    kv_copies: tuple[torch.Tensor, torch.Tensor] | None = None
    # [num_sampled] int64: the page-table row of each sampled segment, plan order (where the
    # executor keeps each row's last sampled token: deferred_inputs.py)
    sampled_rows: torch.Tensor | None = None
    # [D] int64 flat token rows whose input is their page-table row's last sampled token
    # (BatchPlan.deferred), and [D] int64 those rows: filled in on the device, over arrays
    deferred_at: torch.Tensor | None = None
    deferred_rows: torch.Tensor | None = None

    @property
    def hidden_rows(self) -> torch.Tensor:
        """The rows whose final hidden states the forward keeps: sampled, then scored."""
        if self.score_indices is None:
            return self.sample_indices
        return torch.cat((self.sample_indices, self.score_indices))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_extends(self) -> int:
        return int(self.extend_seq_lens.shape[0])

    @property
    def num_decodes(self) -> int:
        return int(self.decode_seq_lens.shape[0])


class HostStaging:
    """Pinned host buffers that a CUDA step's index arrays are packed into, reused across steps,
    so that a step's inputs reach the device in two asynchronous copies (one int64, one int32)
    instead of one blocking copy per tensor. Each reuse first waits for the previous copy out
    of the buffer (an event), never for the GPU's other work."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._copied: dict[torch.dtype, torch.cuda.Event] = {}

    def to_device(self, array: np.ndarray, device: torch.device) -> torch.Tensor:
        dtype = _TORCH_DTYPES[array.dtype.type]
        n = array.shape[0]
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.shape[0] < n:
            size = max(n, 2 * (buffer.shape[0] if buffer is not None else 4096))
            buffer = torch.empty(size, dtype=dtype, pin_memory=True)
            self._buffers[dtype] = buffer
        elif dtype in self._copied:
            self._copied[dtype].synchronize()
        host = buffer[:n]
        host.numpy()[:] = array
        out = host.to(device, non_blocking=True)
        event = self._copied.setdefault(dtype, torch.cuda.Event())
        event.record()
        return out


_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32}


def build_forward_batch(
    plan: BatchPlan,
    page_table: np.ndarray,
    page_size: int,
    device: torch.device,
    staging: HostStaging | None = None,
    verify_decode_rows: int = 0,
) -> ForwardBatch:
    """Vectorized over tokens: the only Python loops walk segments, never tokens (and decodes,
    the many one-token segments, in a single pass).

    A plan with guesses (speculative decoding) runs its decodes as extends, unless it has no
    other extend and at most ``verify_decode_rows`` tokens: then each verified position is a
    decode row of its own (same table row, kv length up to that position; every row's K/V is
    stored before any row attends), in the same flat order, so a batch-1 verify takes the
    fused decode step (executor/cpu/native_decode.py) instead of the extend path.

    ``page_table`` is the [max_rows, max_pages] int32 array of page ids (a numpy view).
    On a CPU the tensors are views of the numpy arrays (no copy); on CUDA the int64 arrays
    travel packed in one buffer and the int32 ones in another (two copies, through
    ``staging``'s pinned buffers when given), split on the device. A lone decode on a CPU (one
    stream) takes ``_one_decode_batch``: the same tensors without the vectorized passes.
    """
    if (
        len(plan.decodes) == 1
        and not plan.extends
        and not plan.num_guesses
        and not plan.deferred
        and device.type == "cpu"
        and len(plan.decodes[0].input_ids) == 1
    ):
        return _one_decode_batch(plan, page_table, page_size)
    return _vectorized_batch(plan, page_table, page_size, device, staging, verify_decode_rows)


def _vectorized_batch(
    plan: BatchPlan,
    page_table: np.ndarray,
    page_size: int,
    device: torch.device,
    staging: HostStaging | None,
    verify_decode_rows: int,
) -> ForwardBatch:
    """build_forward_batch over numpy arrays of all the plan's segments."""
    extends, decodes = plan.extends, plan.decodes
    if plan.num_guesses:
        if plan.deferred:
            raise ValueError(f"plan {plan.step} defers inputs beside guessed tokens")
        if not extends and sum(len(s.input_ids) for s in decodes) <= verify_decode_rows:
            rows = _verified_as_decodes(plan)
            return build_forward_batch(rows, page_table, page_size, device, staging)
        extends, decodes = extends + decodes, []  # every decode runs as an extend
    num_ext, num_dec = len(extends), len(decodes)
    # one pass over the decodes: table row, position, token, sampled?, token count
    dec = np.array(
        [(s.row, s.start_pos, s.input_ids[0], s.sample, len(s.input_ids)) for s in decodes],
        dtype=np.int64,
    ).reshape(num_dec, 5)
    if num_dec and (dec[:, 4] != 1).any():
        bad = decodes[int(np.flatnonzero(dec[:, 4] != 1)[0])]
        raise ValueError(f"decode segment {bad.rid!r} has {bad.num_tokens} tokens, expected 1")
    dec_rows, dec_starts = dec[:, 0], dec[:, 1]
    ext = np.array(
        [(s.row, s.start_pos, len(s.input_ids), s.sample) for s in extends], dtype=np.int64
    ).reshape(num_ext, 4)
    ext_rows, ext_starts, ext_lens = ext[:, 0], ext[:, 1], ext[:, 2]
    cu = np.zeros(num_ext + 1, np.int64)
    np.cumsum(ext_lens, out=cu[1:])
    n_ext = int(cu[-1])
    n = n_ext + num_dec
    ext_seq_lens = ext_starts + ext_lens
    dec_seq_lens = dec_starts + 1
    ext_max = int(ext_seq_lens.max()) if num_ext else 0
    dec_max = int(dec_seq_lens.max()) if num_dec else 0
    ext_width = -(-ext_max // page_size)
    dec_width = -(-dec_max // page_size)
    if num_ext:
        token_segment = np.repeat(np.arange(num_ext), ext_lens)
        ext_positions = np.arange(n_ext) - cu[:-1][token_segment] + ext_starts[token_segment]
        positions = np.concatenate([ext_positions, dec_starts])
        token_rows = np.concatenate([ext_rows[token_segment], dec_rows])
        input_ids = np.fromiter(
            chain(chain.from_iterable(s.input_ids for s in extends), dec[:, 2]), np.int64, n
        )
    else:
        positions, token_rows, input_ids = dec_starts, dec_rows, dec[:, 2]
    slots = page_table[token_rows, positions // page_size].astype(np.int64) * page_size
    slots += positions % page_size
    sampled = np.concatenate([cu[1:][ext[:, 3] != 0] - 1, n_ext + np.flatnonzero(dec[:, 3])])
    scored = _score_rows(plan, cu)
    longs = [input_ids, positions, slots, sampled, token_rows[sampled]]
    if plan.deferred:  # their flat token rows and page-table rows, in the same copy
        deferred = np.asarray(plan.deferred, dtype=np.int64)
        longs += [n_ext + deferred, dec_rows[deferred]]

    tensors = _to_device(
        longs,
        [
            page_table[ext_rows, :ext_width],
            ext_seq_lens.astype(np.int32),
            cu.astype(np.int32),
            page_table[dec_rows, :dec_width],
            dec_seq_lens.astype(np.int32),
        ],
        device,
        staging,
    )
    ext_table, ext_lens_t, cu_t, dec_table, dec_lens_t = tensors[len(longs) :]
    ids_t, positions_t, slots_t, sampled_t, sampled_rows_t = tensors[:5]
    deferred_at_t = deferred_rows_t = None
    if plan.deferred:
        deferred_at_t, deferred_rows_t = tensors[5:7]
    score_t = None
    if scored is not None:
        score_t = torch.from_numpy(scored).to(device)
    kv_copies = None
    if plan.kv_copies:
        pairs = torch.tensor(plan.kv_copies, dtype=torch.int64).to(device)
        kv_copies = (pairs[:, 0], pairs[:, 1])
    return ForwardBatch(
        score_indices=score_t,
        kv_copies=kv_copies,
        input_ids=ids_t,
        positions=positions_t,
        slot_mapping=slots_t,
        sample_indices=sampled_t,
        page_size=page_size,
        num_extend_tokens=n_ext,
        extend_block_table=ext_table,
        extend_seq_lens=ext_lens_t,
        extend_cu_seqlens_q=cu_t,
        extend_max_q_len=int(ext_lens.max()) if num_ext else 0,
        extend_max_seq_len=ext_max,
        decode_block_table=dec_table,
        decode_seq_lens=dec_lens_t,
        decode_max_seq_len=dec_max,
        sampled_rows=sampled_rows_t,
        deferred_at=deferred_at_t,
        deferred_rows=deferred_rows_t,
    )


def _one_decode_batch(plan: BatchPlan, page_table: np.ndarray, page_size: int) -> ForwardBatch:
    """``_vectorized_batch`` of a plan of one one-token decode (nothing else) on a CPU, from
    Python ints: its ~30 numpy calls took ~80 us of a batch-1 step. The same tensors (dtypes,
    shapes, values; the block table a copy of the page-table row, as there)."""
    seg = plan.decodes[0]
    position = seg.start_pos
    seq_len = position + 1
    slot = int(page_table[seg.row, position // page_size]) * page_size + position % page_size
    kv_copies = None
    if plan.kv_copies:
        pairs = torch.tensor(plan.kv_copies, dtype=torch.int64)
        kv_copies = (pairs[:, 0], pairs[:, 1])
    longs = torch.from_numpy(
        np.array([seg.input_ids[0], position, slot, 0, seg.row], dtype=np.int64)
    )
    ints = torch.from_numpy(np.array([seq_len, 0], dtype=np.int32))
    return ForwardBatch(
        input_ids=longs[0:1],
        positions=longs[1:2],
        slot_mapping=longs[2:3],
        sample_indices=longs[3:4] if seg.sample else longs[3:3],
        page_size=page_size,
        num_extend_tokens=0,
        extend_block_table=ints[:0].view(0, 0),
        extend_seq_lens=ints[:0],
        extend_cu_seqlens_q=ints[1:2],
        extend_max_q_len=0,
        extend_max_seq_len=0,
        decode_block_table=torch.from_numpy(
            page_table[seg.row : seg.row + 1, : -(-seq_len // page_size)].copy()
        ),
        decode_seq_lens=ints[0:1],
        decode_max_seq_len=seq_len,
        kv_copies=kv_copies,
        sampled_rows=longs[4:5] if seg.sample else longs[4:4],
    )


def _verified_as_decodes(plan: BatchPlan) -> BatchPlan:
    """The plan's decode segments, each verified row split into one-token decodes (only the
    last one sampled, as the row was), for ``build_forward_batch``'s layout alone."""
    rows = [
        replace(
            s,
            input_ids=[token],
            start_pos=s.start_pos + j,
            sample=s.sample and j == len(s.input_ids) - 1,
            guesses=0,
        )
        for s in plan.decodes
        for j, token in enumerate(s.input_ids)
    ]
    return replace(plan, decodes=rows, page_writes=[])


def _score_rows(plan: BatchPlan, cu: np.ndarray) -> np.ndarray | None:
    """The flat rows of the extend tokens whose logits score prompt tokens, or None. A scoring
    with a ``lead`` takes its first row from the segment that computes that position."""
    index = {s.rid: i for i, s in enumerate(plan.extends)} if plan.kv_copies else {}
    pieces: list[np.ndarray] = []
    for i, s in enumerate(plan.extends):
        sc = s.scoring
        if sc is None:
            continue
        if sc.lead is None:
            pieces.append(cu[i] + (sc.first - s.start_pos) + np.arange(sc.num_positions))
            continue
        j = index[sc.lead]
        lead = plan.extends[j]
        assert sc.first == s.start_pos - 1 and lead.start_pos <= sc.first < lead.end_pos
        pieces.append(np.array([cu[j] + sc.first - lead.start_pos]))
        pieces.append(cu[i] + np.arange(sc.num_positions - 1))
    return np.concatenate(pieces).astype(np.int64) if pieces else None


def _to_device(
    longs: list[np.ndarray],
    ints: list[np.ndarray],
    device: torch.device,
    staging: HostStaging | None,
    packed: bool | None = None,
) -> list[torch.Tensor]:
    """int64 and int32 arrays as tensors on ``device``, in order: on a CPU views of the arrays
    (no copy); elsewhere (or with ``packed``) each dtype packed into one buffer, copied once,
    split on the device."""
    if not (device.type != "cpu" if packed is None else packed):
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in (*longs, *ints)]
    out: list[torch.Tensor] = []
    for group in (longs, ints):
        joined = np.concatenate([a.reshape(-1) for a in group])
        if staging is not None and device.type == "cuda":
            flat = staging.to_device(joined, device)
        else:
            flat = torch.from_numpy(joined).to(device)
        pieces = torch.split(flat, [a.size for a in group])
        out += [p.view(a.shape) for p, a in zip(pieces, group, strict=True)]
    return out
