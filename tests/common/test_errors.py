"""The engine's errors survive pickling, as Ray carries a replica's refusal to the HTTP app
(``--replicas``): same type, message, ``param`` and ``code``, so the same HTTP error."""

from __future__ import annotations

import pickle

import pytest

from asyncengine.common.errors import (
    AdapterUnavailableError,
    InvalidRequestError,
    QueueFullError,
    UnknownAdapterError,
)


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequestError("bad value", param="top_k", code="invalid_value"),
        UnknownAdapterError("nope", ["alpha", "beta"]),
        AdapterUnavailableError("gone"),
        QueueFullError("too many waiting"),
    ],
)
def test_an_engine_error_pickles_as_itself(error: Exception) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert getattr(back, "param", None) == getattr(error, "param", None)
    assert getattr(back, "code", None) == getattr(error, "code", None)
