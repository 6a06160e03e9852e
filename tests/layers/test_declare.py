"""`layers.common.declare`: applying a module reads each given parameter and checks its shape (no initializer traced);
initializing declares it with its logical axes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors as flax_errors

from v41cp.layers.common import declare


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = declare(self, "w", (x.shape[-1], 3), ("embed", "mlp"), jnp.float32)
        return x @ w


@pytest.mark.fast
def test_apply_reads_the_given_parameter_and_refuses_a_wrong_shape():
    x = jnp.ones((2, 4), jnp.float32)
    boxed = _Dense().init(jax.random.key(0), x)["params"]
    assert isinstance(boxed["w"], nn.Partitioned) and boxed["w"].names == ("embed", "mlp")
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(_Dense().apply({"params": {"w": w}}, x), np.ones((2, 4)) @ w)
    wrong = r"\"w\".*expected to generate shape \(4, 3\).*has shape \(4, 2\)"
    with pytest.raises(flax_errors.ScopeParamShapeError, match=wrong):
        _Dense().apply({"params": {"w": np.zeros((4, 2), np.float32)}}, x)
