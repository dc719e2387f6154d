"""ForwardBatch: a BatchPlan turned into the flat tensors of one forward, built once per plan."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from asyncengine.plan import BatchPlan


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

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_extends(self) -> int:
        return int(self.extend_seq_lens.shape[0])

    @property
    def num_decodes(self) -> int:
        return int(self.decode_seq_lens.shape[0])


def build_forward_batch(
    plan: BatchPlan, page_table: np.ndarray, page_size: int, device: torch.device
) -> ForwardBatch:
    """Vectorized over tokens: the only Python loops walk segments, never tokens.

    ``page_table`` is the [max_requests, max_pages] int32 array of page ids (a numpy view).
    """
    extends, decodes = plan.extends, plan.decodes
    for seg in decodes:
        if seg.num_tokens != 1:
            raise ValueError(f"decode segment {seg.rid!r} has {seg.num_tokens} tokens, expected 1")
    ext_rows = np.fromiter((s.table_row for s in extends), np.int64, len(extends))
    ext_starts = np.fromiter((s.start_pos for s in extends), np.int64, len(extends))
    ext_lens = np.fromiter((s.num_tokens for s in extends), np.int64, len(extends))
    dec_rows = np.fromiter((s.table_row for s in decodes), np.int64, len(decodes))
    dec_starts = np.fromiter((s.start_pos for s in decodes), np.int64, len(decodes))
    cu = np.zeros(len(extends) + 1, np.int64)
    np.cumsum(ext_lens, out=cu[1:])
    n_ext = int(cu[-1])

    token_segment = np.repeat(np.arange(len(extends)), ext_lens)
    ext_positions = np.arange(n_ext) - cu[:-1][token_segment] + ext_starts[token_segment]
    positions = np.concatenate([ext_positions, dec_starts])
    token_rows = np.concatenate([ext_rows[token_segment], dec_rows])
    slots = page_table[token_rows, positions // page_size].astype(np.int64) * page_size
    slots += positions % page_size

    ext_seq_lens = ext_starts + ext_lens
    dec_seq_lens = dec_starts + 1
    ext_max = int(ext_seq_lens.max()) if len(extends) else 0
    dec_max = int(dec_seq_lens.max()) if len(decodes) else 0
    ext_table = page_table[ext_rows, : -(-ext_max // page_size)]
    dec_table = page_table[dec_rows, : -(-dec_max // page_size)]

    sampled = [cu[i + 1] - 1 for i, s in enumerate(extends) if s.sample]
    sampled += [n_ext + j for j, s in enumerate(decodes) if s.sample]
    input_ids = list(chain.from_iterable(s.input_ids for s in extends))
    input_ids += [s.input_ids[0] for s in decodes]

    def tensor(array: np.ndarray | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(array), dtype=dtype).to(device)

    return ForwardBatch(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        slot_mapping=tensor(slots, torch.int64),
        sample_indices=tensor(np.asarray(sampled, np.int64), torch.int64),
        page_size=page_size,
        num_extend_tokens=n_ext,
        extend_block_table=tensor(ext_table, torch.int32),
        extend_seq_lens=tensor(ext_seq_lens, torch.int32),
        extend_cu_seqlens_q=tensor(cu, torch.int32),
        extend_max_q_len=int(ext_lens.max()) if len(extends) else 0,
        extend_max_seq_len=ext_max,
        decode_block_table=tensor(dec_table, torch.int32),
        decode_seq_lens=tensor(dec_seq_lens, torch.int32),
        decode_max_seq_len=dec_max,
    )
