"""The engine's compiled programs are unchanged by refactors: the decode, verify, span-prefill and model-wide QCP
prefill programs at tiny sizes (one device and the 8-device topologies) have exactly the FLOPs, temporaries,
argument / output / alias bytes and collective bytes recorded in `tests/data/compiled_structure.json`
(`tests/compiled_structure.py`). A program that changes on purpose is re-recorded in the same commit, with the
reason in its message."""

import jax
import pytest
from compiled_structure import PROGRAMS, measure, recorded

RECORD = recorded()


@pytest.mark.skipif(RECORD["jax"] != jax.__version__,
                    reason=f"figures recorded with jax {RECORD['jax']}; XLA {jax.__version__} compiles other programs")
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_structure_equals_the_record(name):
    assert measure([name])[name] == RECORD["programs"][name]
