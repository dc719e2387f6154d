"""The skip marker of the tests that need the native CPU kernels: they are built by a C
compiler, so only a missing compiler skips them (a kernel that fails to build with one fails
its tests)."""

from __future__ import annotations

import pytest

from asyncengine.kernels.cpu import cpu_native

needs_native = pytest.mark.skipif(
    not cpu_native.compiler_found(), reason="no C compiler: the native kernels cannot be built"
)
