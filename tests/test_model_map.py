"""The model map is found from the graph, for timm families and in-house models alike."""

import pytest
import timm
import torch
from torch import nn

from tests.fixtures import inhouse
from tests.models import VANILLA
from vitcompress import map_model
from vitcompress.analysis.analyse import MappingError


@pytest.mark.parametrize("name", list(VANILLA))
def test_vanilla_maps(name):
    factory, size, prefix, kind = VANILLA[name]
    model_map = map_model(factory(), size).to_json()
    assert model_map["prefix_tokens"] == prefix
    assert model_map["grid"] == [8, 8]
    assert len(model_map["blocks"]) == 4
    for i, block in enumerate(model_map["blocks"]):
        assert block["index"] == i
        assert block["tokens"] == prefix + 64
        assert block["dim"] == 64
        assert block["attention"] == kind
        assert block["grid_ops"] == []
    assert model_map["blocks"][0]["heads"] == (4 if name.startswith("inhouse") else 2)


def test_block_paths_and_cls_detection():
    assert map_model(VANILLA["vit"][0](), (3, 32, 32)).blocks[2].path == "blocks.2"
    assert map_model(inhouse.mha_vit(), (3, 32, 32)).blocks[1].path == "layers.1"
    assert map_model(inhouse.register_vit(), (3, 32, 32)).blocks[3].path == "body.3"
    assert map_model(VANILLA["vit"][0](), (3, 32, 32)).cls_token
    assert map_model(inhouse.register_vit(), (3, 32, 32)).cls_token  # cls + 3 registers
    assert not map_model(VANILLA["vit_registers"][0](), (3, 32, 32)).cls_token  # registers, GAP
    assert not map_model(inhouse.einsum_vit(), (3, 32, 32)).cls_token


@pytest.mark.parametrize(
    "name, prefix, heads",
    [
        ("deit_small_patch16_224", 1, 6),
        ("deit_tiny_distilled_patch16_224", 2, 3),
        ("deit3_small_patch16_224", 1, 6),
        ("vit_base_patch16_224", 1, 12),
    ],
)
def test_full_size_timm_vits(name, prefix, heads):
    model_map = map_model(timm.create_model(name)).to_json()
    assert model_map["prefix_tokens"] == prefix and model_map["grid"] == [14, 14]
    assert len(model_map["blocks"]) == 12
    assert {b["tokens"] for b in model_map["blocks"]} == {196 + prefix}
    assert {b["heads"] for b in model_map["blocks"]} == {heads}


def test_pvt_v2_stages_and_grid_ops():
    model_map = map_model(timm.create_model("pvt_v2_b0")).to_json()
    assert [s["grid"] for s in model_map["stages"]] == [[56, 56], [28, 28], [14, 14], [7, 7]]
    assert [b["tokens"] for b in model_map["blocks"]] == [3136] * 2 + [784] * 2 + [196] * 2 + [
        49
    ] * 2
    first = model_map["blocks"][0]["grid_ops"]
    assert [(op["path"], op["branch"], op["grid"]) for op in first] == [
        ("stages.0.blocks.0.attn.sr", "attention", [56, 56]),
        ("stages.0.blocks.0.mlp.dwconv", "mlp", [56, 56]),
    ]
    last = model_map["blocks"][-1]["grid_ops"]  # no spatial reduction in the last stage
    assert [op["path"] for op in last] == ["stages.3.blocks.1.mlp.dwconv"]
    # Each key reads its sr x sr cell (the SR conv's kernel, stride and no padding); the last
    # stage's keys are its tokens.
    pools = [b.get("key_pool") for b in model_map["blocks"]]
    assert pools == [[[s, s], [s, s], [0, 0]] for s in (8, 8, 4, 4, 2, 2)] + [None, None]


def test_inhouse_pyramid():
    model_map = map_model(inhouse.tiny_pyramid()).to_json()
    assert [s["grid"] for s in model_map["stages"]] == [[16, 16], [8, 8], [4, 4]]
    assert [len(s["blocks"]) for s in model_map["stages"]] == [1, 2, 2]
    kinds = [[op["path"].split(".")[-1] for op in b["grid_ops"]] for b in model_map["blocks"]]
    assert kinds == [["reduce", "mix"], ["reduce", "mix"], ["reduce", "mix"], ["mix"], ["mix"]]


def test_a_model_without_attention_says_what_is_missing():
    cnn = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)
    )
    with pytest.raises(MappingError, match="no transformer block found: 0 attention core"):
        map_model(cnn, (3, 16, 16))


def test_untraceable_submodule_is_kept_whole():
    class Stubborn(nn.Module):  # control flow on a tensor value: symbolic tracing fails here
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)

        def forward(self, x):
            if x.sum() > 1e9:
                return x
            return self.fc(x)

    model = inhouse.einsum_vit()
    model.trunk[1].ffn = Stubborn()
    model_map = map_model(model, (3, 32, 32))
    assert model_map.leaves == ["trunk.1.ffn"]
    assert len(model_map.blocks) == 4
    x = torch.randn(2, 3, 32, 32)
    import vitcompress

    compressed = vitcompress.compress(model, "etps", keep=1.0, locs=[1], input_size=(3, 32, 32))
    with torch.no_grad():
        torch.testing.assert_close(compressed.eval()(x), model.eval()(x))


def test_a_check_on_the_input_shape_is_captured_by_the_guarded_trace():
    class Checked(nn.Module):  # HuggingFace-style input check at the top level
        def __init__(self):
            super().__init__()
            self.inner = inhouse.register_vit()

        def forward(self, pixels):
            if pixels.shape[1] != 3:  # a proxy in control flow: plain symbolic tracing fails
                raise ValueError("bad input")
            return self.inner(pixels)

    model_map = map_model(Checked(), (3, 32, 32)).to_json()
    assert model_map["capture"] == "guarded_trace"
    assert model_map["prefix_tokens"] == 4 and len(model_map["blocks"]) == 4
    assert {b["attention"] for b in model_map["blocks"]} == {"matmul_softmax"}
    assert model_map["blocks"][0]["path"] == "inner.body.0"


def test_the_guarded_trace_lets_go_of_values_the_traced_code_dropped():
    # The guarded trace runs the example alongside; keeping every node's value held the whole
    # model's activations at once (SAM-B at 1024 px ran out of 24 GB). A value must go when the
    # traced code drops its proxy, as an eager run frees it.
    from vitcompress.analysis.capture import GuardedTracer

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(24))

        def forward(self, x):
            if x.shape[-1] != 16:  # metadata control flow: what the guarded trace is for
                raise ValueError("bad input")
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    example = torch.randn(2, 16)
    tracer = GuardedTracer(set(), (example,))
    graph = tracer.trace(Deep())
    assert len(graph.nodes) > 48  # a linear and a relu per layer
    # What is still held after the trace: the parameters' cached proxies, nothing per layer.
    held = [node for node in tracer._values if node.op not in ("get_attr", "placeholder")]
    assert len(held) <= 2, [node.name for node in held]
    # And the guard on the input check was still decided on the example's value.
    assert any(node.target is torch._assert for node in graph.nodes)


class _PooledKeys(nn.Module):
    """An attention whose keys a 3 x 3 stride-2 conv pools from the patch tokens, with the cls
    token's key joined in front (``cls_front``), a register's key joined behind (``after``), or
    the keys' channels made of two halves (``channels``)."""

    def __init__(self, dim: int, form: str) -> None:
        super().__init__()
        self.form = form
        self.q, self.kv, self.proj = (
            nn.Linear(dim, dim),
            nn.Linear(dim, 2 * dim),
            nn.Linear(dim, dim),
        )
        self.sr = nn.Conv2d(dim, dim, 3, 2, 1)
        self.register = nn.Parameter(torch.randn(1, 1, dim))

    def forward(self, x: torch.Tensor, side: int) -> torch.Tensor:
        batch, tokens, dim = x.shape
        grid = x[:, 1:].transpose(1, 2).reshape(batch, dim, side, side)
        pooled = self.sr(grid).flatten(2).transpose(1, 2)
        if self.form == "cls_front":
            pooled = torch.cat([x[:, :1], pooled], dim=1)
        elif self.form == "after":
            pooled = torch.cat([pooled, self.register.expand(batch, -1, -1)], dim=1)
        k, v = self.kv(pooled).chunk(2, dim=-1)
        if self.form == "channels":
            k = torch.cat([k[..., : dim // 2], k[..., dim // 2 :] * 2], dim=-1)
        q, k, v = (t.reshape(batch, t.shape[1], 2, -1).transpose(1, 2) for t in (self.q(x), k, v))
        attn = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(batch, tokens, dim))


class _PooledKeysBlock(nn.Module):
    def __init__(self, dim: int, form: str) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), _PooledKeys(dim, form)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, side: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), side)
        return x + self.mlp(self.norm2(x))


class _PooledKeysNet(nn.Module):
    def __init__(self, form: str, dim: int = 32) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 8, 8)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.ModuleList([_PooledKeysBlock(dim, form) for _ in range(2)])
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        side = x.shape[-1]
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x.flatten(2).transpose(1, 2)], 1)
        for block in self.blocks:
            x = block(x, side)
        return self.head(x[:, 0])


@pytest.mark.parametrize(
    ("form", "pool"),
    [
        ("cls_front", ((3, 3), (2, 2), (1, 1))),  # CvT's last stage: the cls key in front
        ("channels", ((3, 3), (2, 2), (1, 1))),  # a cat along the channels: walked through
        ("after", None),  # a key behind the pooled ones: they would be misplaced on the grid
    ],
)
def test_a_pooled_key_grid_is_found_through_a_cat_only_along_the_keys_and_behind_the_prefix(
    form: str, pool: tuple | None
) -> None:
    model_map = map_model(_PooledKeysNet(form).eval(), (3, 64, 64))
    assert [block.attention.key_pool for block in model_map.blocks] == [pool, pool]
