"""RoPE inverse frequencies equal the oracle's bit for bit at the released (64) and tiny (16) rope dims."""

import numpy as np
import pytest
from safetensors.numpy import load_file

from v41cp.config import preset
from v41cp.layers.rope import rope_frequencies

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)


@pytest.mark.oracle
@pytest.mark.parametrize("name", ["v41-flash", "tiny"])
@pytest.mark.parametrize("table", ["main", "compress"])
def test_rope_frequencies_bit_exact(oracle, name, table):
    ref = load_file(str(oracle.run("rope") / "rope.safetensors"))[f"{name}_{table}"]
    np.testing.assert_array_equal(rope_frequencies(preset(name), table == "compress"), ref)
