"""Every rows backend implements the whole `RowsBackend` protocol itself: each method and attribute the layers ask
for is defined by the backend class (not inherited from the protocol's bodies)."""

import inspect

import pytest

from v41cp.layers.rows_backend import RowsBackend
from v41cp.serving.attention.paged_rows import PagedRows
from v41cp.serving.attention.qcp_rows import QCPRows

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)

MEMBERS = sorted({n for n in vars(RowsBackend) if not n.startswith("_")} | set(RowsBackend.__annotations__))


def test_the_protocol_lists_what_the_layers_ask_for():
    assert {"pos", "valid", "narrows", "window", "group_first", "write_entries", "history", "select", "attend",
            "ced_split", "sampled", "last_rows"} == set(MEMBERS)


@pytest.mark.parametrize("backend", [PagedRows, QCPRows])
def test_backend_defines_every_member(backend):
    source = inspect.getsource(backend)
    missing = [n for n in MEMBERS if n not in vars(backend) and f"self.{n} =" not in source
               and f"self.{n}, " not in source]
    assert not missing, f"{backend.__name__} does not define {missing}"
    assert RowsBackend in backend.__mro__
