"""Every rows backend implements the whole `RowsBackend` protocol: each method and attribute the layers ask for is
defined by the backend class or by `CachedRows` (never inherited from the protocol's empty bodies), and the cached
backends define what `CachedRows` builds on (`group_first`, `select_queries`)."""

import inspect

import pytest

from v41cp.layers.full_sequence import FullSequence
from v41cp.layers.rows_backend import CachedRows, RowsBackend
from v41cp.serving.attention.paged_rows import PagedRows
from v41cp.serving.attention.qcp_rows import QCPRows

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)

MEMBERS = sorted({n for n in vars(RowsBackend) if not n.startswith("_")} | set(RowsBackend.__annotations__))


def test_the_protocol_lists_what_the_layers_ask_for():
    assert {"pos", "valid", "narrows", "columns", "window", "groups", "write_entries", "history", "select", "attend",
            "ced_split", "sampled", "last_rows", "every_entry"} == set(MEMBERS)


@pytest.mark.parametrize("backend", [FullSequence, PagedRows, QCPRows])
def test_backend_defines_every_member(backend):
    source = inspect.getsource(backend)
    own = lambda n: any(n in vars(k) for k in backend.__mro__ if k not in (RowsBackend, object) and k.__module__
                        != "typing")
    missing = [n for n in MEMBERS if not own(n) and f"self.{n} =" not in source and f"self.{n}, " not in source]
    assert not missing, f"{backend.__name__} does not define {missing}"
    assert RowsBackend in backend.__mro__
    if CachedRows in backend.__mro__:
        assert "group_first" in vars(backend) and "select_queries" in vars(backend)
