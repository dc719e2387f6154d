"""KVPool: the K and V tensors of every layer, addressed by token slot.

Slot ``page * page_size + offset`` holds one token's keys/values for one layer. Page accounting
lives in KVCacheManager; this class only owns memory. An int8 pool's head rows carry their
scale after the values (``row_width`` = head_dim + 2: kernels/reference/kv_int8_ref.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from asyncengine.kernels.reference.kv_int8_ref import pool_row

if TYPE_CHECKING:
    from asyncengine.executor.layers.model_config import ModelConfig


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, num_kv_heads, head_dim, num_pages, page_size) <= 0:
            raise ValueError(
                f"KVPool sizes must be positive: layers={num_layers} kv_heads={num_kv_heads} "
                f"head_dim={head_dim} pages={num_pages} page_size={page_size}"
            )
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_pages * page_size, num_kv_heads, pool_row(head_dim, dtype))
        # On a CPU the pool is left unwritten (no slot is read before it is stored): the OS then
        # maps its pages in as requests first use them, so an idle server's resident memory does
        # not carry the whole pool (32768 float32 tokens of SmolLM2 are 1.5 GB).
        make = torch.empty if self.device.type == "cpu" else torch.zeros
        self.k = make(shape, dtype=dtype, device=self.device)
        self.v = make(shape, dtype=dtype, device=self.device)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages, every layer, in order: ``(source, destination)`` page ids."""
        ps = self.page_size
        for src, dst in copies:
            self.k[:, dst * ps : (dst + 1) * ps] = self.k[:, src * ps : (src + 1) * ps]
            self.v[:, dst * ps : (dst + 1) * ps] = self.v[:, src * ps : (src + 1) * ps]

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVPool:
        """A pool in the shape of ``config``'s layers and K/V heads."""
        return cls(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            num_pages,
            page_size,
            dtype,
            device,
        )

    @property
    def row_width(self) -> int:
        """Elements of one head's row: head_dim, or head_dim + 2 (its scale) in an int8 pool."""
        return pool_row(self.head_dim, self.dtype)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def k_cache(self, layer: int) -> torch.Tensor:
        """Keys of one layer: a view ``[num_slots, num_kv_heads, row_width]``."""
        return self.k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Values of one layer: a view ``[num_slots, num_kv_heads, row_width]``."""
        return self.v[layer]

    @property
    def bytes_per_token(self) -> int:
        return self.token_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers (an int8 pool's scales included)."""
        return 2 * num_layers * num_kv_heads * pool_row(head_dim, dtype) * _element_size(dtype)

    @staticmethod
    def num_pages_for_tokens(num_tokens: int, page_size: int) -> int:
        """Pages needed to hold ``num_tokens`` token slots (rounded up)."""
        return -(-num_tokens // page_size)

    @classmethod
    def num_pages_for_bytes(
        cls,
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
    ) -> int:
        """The most pages whose K and V fit in ``budget_bytes`` (rounded down)."""
        page_bytes = cls.token_bytes(num_layers, num_kv_heads, head_dim, dtype) * page_size
        return budget_bytes // page_bytes
