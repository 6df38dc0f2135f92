import importlib.util

import pytest

from glm53 import _buildinfo
from glm53.tiers.vram_cache import EC_FIELDS, ec_dtype

cuda_built = importlib.util.find_spec("glm53._cuda") is not None


def test_buildinfo_matches_what_was_built():
    assert _buildinfo.cuda_built == cuda_built


@pytest.mark.skipif(
    not cuda_built, reason="glm53 was built without nvcc (-Dcuda=disabled or none found)"
)
def test_expert_cache_struct_mirror_matches_the_compiled_layout():
    from glm53 import _cuda

    layout = _cuda.ec_layout()
    dt = ec_dtype(layout)
    assert dt.itemsize == layout[-1]
    assert [dt.fields[name][1] for name, _, _ in EC_FIELDS] == layout[:-1]
    # offsets strictly increase and every field fits before the next
    for (name, _, _), nxt in zip(EC_FIELDS, layout[1:], strict=True):
        assert dt.fields[name][1] + dt.fields[name][0].itemsize <= nxt


def test_mirror_rejects_a_foreign_layout():
    with pytest.raises(RuntimeError, match="rebuild glm53"):
        ec_dtype([0, 4, 8])
