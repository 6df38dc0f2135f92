import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from glm53.models.checkpoint import MUL1_MARKER, Checkpoint, read_safetensors_header
from glm53.synth.shapes import preset
from glm53.synth.writer import write_checkpoint


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "ckpt"
    # small shards so that the reader has to stitch several files together
    write_checkpoint(
        preset("demo"),
        out,
        seed=3,
        routing_mode="uniform",
        shard_bytes=4 << 20,
        routing_source="stand-in",
    )
    return out


def test_demo_is_split_over_several_shards(demo_dir):
    assert len(sorted(demo_dir.glob("*.safetensors"))) == 6


def test_header_offsets_read_the_same_values_as_the_safetensors_library(demo_dir):
    ckpt = Checkpoint(demo_dir)
    seen = 0
    for shard in sorted(demo_dir.glob("*.safetensors")):
        for key, ref in load_file(str(shard)).items():
            ours = ckpt.read(key)
            if ref.dtype == torch.bfloat16:
                ref = ref.view(torch.uint16)
            assert ours.shape == tuple(ref.shape), key
            np.testing.assert_array_equal(ours, ref.numpy(), err_msg=key)
            seen += 1
    # the verified tiny layout (1,502 tensors with 16 experts) plus 16 more experts in 6 layers
    assert seen == len(ckpt.tensors) == 1502 + 16 * 12 * 6


def test_read_f32_widens_bf16_exactly(demo_dir):
    ckpt = Checkpoint(demo_dir)
    key = "model.language_model.embed_tokens.weight"
    ref = load_file(str(ckpt.info(key).path))[key].float().numpy()
    np.testing.assert_array_equal(ckpt.read_f32(key), ref)


def test_experts_list_every_routed_expert_of_every_moe_layer(demo_dir):
    ckpt = Checkpoint(demo_dir)
    assert ckpt.moe_layers == [2, 3, 4, 5, 6, 7]
    assert ckpt.expert_keys() == {layer: set(range(32)) for layer in ckpt.moe_layers}
    experts = ckpt.experts(5)
    assert [e.expert for e in experts] == list(range(32))
    gate, up, down = experts[17].linears
    assert gate.key == "model.language_model.layers.5.mlp.experts.17.gate_proj"
    assert (gate.in_features, gate.out_features, gate.bits) == (256, 256, 3)
    assert (down.in_features, down.out_features, down.codebook) == (256, 256, "mul1")
    assert up.trellis.shape == (16, 16, 48)
    # trellis 256*256*3/8 + suh/svh 2*(256+256) + marker 4, three projections
    assert experts[17].nbytes == 3 * (24576 + 1024 + 4)
    assert ckpt.read(gate.marker.key) == MUL1_MARKER


def test_expert_tensor_offsets_point_into_their_own_shard(demo_dir):
    ckpt = Checkpoint(demo_dir)
    for expert in ckpt.experts(7):
        for lin in expert.linears:
            for info in (lin.trellis, lin.suh, lin.svh):
                assert info.offset_bytes + info.nbytes <= info.path.stat().st_size
                with open(info.path, "rb") as f:
                    f.seek(info.offset_bytes)
                    raw = f.read(info.nbytes)
                assert raw == ckpt.read(info.key).tobytes()


def test_stale_index_is_reported(demo_dir, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(demo_dir, copy)
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key = "model.language_model.norm.weight"
    right = index["weight_map"][key]
    index["weight_map"][key] = "model-00001-of-00006.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError) as err:
        Checkpoint(copy)
    assert str(err.value) == (
        f"model.safetensors.index.json puts {key} in model-00001-of-00006.safetensors but the "
        f"headers put it in {right}; the index is stale"
    )


def test_missing_config_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        Checkpoint(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / 'config.json'} not found; point at a checkpoint directory "
        "(make one with `glm53 synth --preset demo --out DIR`)"
    )


def test_truncated_shard_is_rejected(demo_dir, tmp_path):
    shard = sorted(demo_dir.glob("*.safetensors"))[-1]
    cut = tmp_path / shard.name
    cut.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match="inside a .*-byte file"):
        read_safetensors_header(cut)
