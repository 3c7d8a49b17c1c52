"""The op audit of an ONNX export (``export --json``'s ``op_audit``): every op type the file uses
with its count, the attributes that decide whether TensorRT's core runs it (a scatter's
``reduction``, TopK's ``sorted``), and ``portable``: false when any op, or attribute value, is
outside TensorRT's core list. The audit is cross-checked against the file read with ``onnx.load``
on all five methods and on a dense-output model, and its verdict on hand-made files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, helper
from torch import nn

import vitcompress
from tests.fixtures import dense_models
from tests.models import timm_small
from vitcompress.cli.main import cli
from vitcompress.workflows.export import export_model
from vitcompress.workflows.onnx_file import PORTABLE_ATTRIBUTES, PORTABLE_OPS, onnx_op_audit

SIZE = (3, 32, 32)
METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")


def read_back(path: Path) -> tuple[Counter, list[tuple[str, dict[str, str]]]]:
    """Op counts and each node's attributes, read with onnx alone (no code under test)."""
    graph = onnx.load(str(path)).graph
    ops = Counter(node.op_type for node in graph.node)
    attributes = [
        (
            node.op_type,
            {
                a.name: str(
                    helper.get_attribute_value(a).decode()
                    if a.type == onnx.AttributeProto.STRING
                    else helper.get_attribute_value(a)
                )
                for a in node.attribute
            },
        )
        for node in graph.node
    ]
    return ops, attributes


def expected_portable(path: Path) -> bool:
    """The portability rule, spelled out independently over the file's nodes."""
    _, nodes = read_back(path)
    defaults = {"reduction": "none", "sorted": "1"}
    for op, attrs in nodes:
        if op not in PORTABLE_OPS:
            return False
        for key, wanted in PORTABLE_ATTRIBUTES.get(op, {}).items():
            if attrs.get(key, defaults[key]) != str(wanted):
                return False
    return True


def check_audit(path: Path, audit: dict) -> None:
    ops, nodes = read_back(path)
    assert audit["ops"] == dict(ops)  # every op type, every node, nothing invented
    for op in PORTABLE_ATTRIBUTES:  # e.g. ScatterElements' reduction, value by value
        if op not in ops:
            assert op not in audit["attributes"]
            continue
        for key in PORTABLE_ATTRIBUTES[op]:
            default = "none" if key == "reduction" else "1"
            seen = Counter(attrs.get(key, default) for name, attrs in nodes if name == op)
            assert audit["attributes"][op][key] == dict(seen)
    assert audit["portable"] is expected_portable(path)
    assert audit["portable"] is (audit["not_portable"] == [])
    for item in audit["not_portable"]:  # every reason names an op that is in the file
        assert item["op"] in ops and item["count"] >= 1


@pytest.fixture(scope="module")
def base() -> nn.Module:
    torch.manual_seed(0)
    return timm_small("vit_small_patch16_224", depth=2).eval()


@pytest.mark.parametrize("method", METHODS)
def test_audit_reports_what_is_in_the_file(base: nn.Module, method: str, tmp_path: Path) -> None:
    model = vitcompress.compress(base, method, keep=0.7, locs=[1], input_size=SIZE).eval()
    out = tmp_path / f"{method}.onnx"
    result = export_model(model, SIZE, "onnx", out, batch_size=2)
    check_audit(out, result["op_audit"])
    # The reducers' stable sort is exported as a sorted TopK, which TensorRT's core runs.
    assert result["op_audit"]["attributes"]["TopK"]["sorted"] == {
        "1": result["op_audit"]["ops"]["TopK"]
    }


def test_audit_of_a_dense_output_model(tmp_path: Path) -> None:
    model, size = dense_models.build("dense_vit")
    compressed = vitcompress.compress(model, "dtps", keep=0.7, input_size=size).eval()
    out = tmp_path / "dense.onnx"
    result = export_model(compressed, size, "onnx", out, batch_size=2)
    check_audit(out, result["op_audit"])


# --------------------------------------------------------------------------------------------------
# The verdict on files with known contents
class ScatterAdd(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.zeros_like(x, dtype=torch.long)
        return torch.zeros_like(x).scatter_add(1, index, x)


class ScatterPlain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = x.argsort(dim=1)
        return torch.zeros_like(x).scatter(1, index, x)


@pytest.mark.parametrize(
    "module,op,reduction,portable",
    [
        (ScatterAdd(), "ScatterElements", "add", False),
        (ScatterPlain(), "ScatterElements", "none", True),
    ],
)
def test_scatter_with_a_reduction_is_not_portable(
    module: nn.Module, op: str, reduction: str, portable: bool, tmp_path: Path
) -> None:
    out = tmp_path / "m.onnx"
    torch.onnx.export(module, (torch.randn(4, 6),), str(out), dynamo=False, opset_version=17)
    audit = onnx_op_audit(out)
    check_audit(out, audit)
    assert audit["attributes"][op]["reduction"] == {reduction: 1}
    assert audit["portable"] is portable
    if not portable:
        [item] = [i for i in audit["not_portable"] if i["op"] == op]
        assert item["attribute"] == {"reduction": reduction} and "reduction=" in item["why"]


def test_scatter_nd_with_a_reduction_is_not_portable(tmp_path: Path) -> None:
    indices = helper.make_node(
        "Constant", [], ["i"], value=helper.make_tensor("i", TensorProto.INT64, [1, 1], [0])
    )
    updates = helper.make_node(
        "Constant", [], ["u"], value=helper.make_tensor("u", TensorProto.FLOAT, [1], [1.0])
    )
    nodes = [indices, updates]
    add = helper.make_node("ScatterND", ["x", "i", "u"], ["y"], reduction="add")
    audit = onnx_op_audit(hand_made(tmp_path / "add.onnx", [*nodes, add]))
    assert audit["attributes"]["ScatterND"] == {"reduction": {"add": 1}}
    assert audit["portable"] is False
    plain = helper.make_node("ScatterND", ["x", "i", "u"], ["y"])  # reduction left out: none
    audit = onnx_op_audit(hand_made(tmp_path / "plain.onnx", [*nodes, plain]))
    assert audit["attributes"]["ScatterND"] == {"reduction": {"none": 1}}
    assert audit["portable"] is True


def hand_made(path: Path, nodes: list, opset_imports: list | None = None) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph(nodes, "g", [x], [y])
    model = helper.make_model(graph, opset_imports=opset_imports or [helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    return path


def test_ops_outside_the_list_or_the_default_domain_are_not_portable(tmp_path: Path) -> None:
    relu = helper.make_node("Relu", ["x"], ["y"])
    assert onnx_op_audit(hand_made(tmp_path / "relu.onnx", [relu]))["portable"] is True
    # Unique is an ONNX op TensorRT's core does not run.
    unique = helper.make_node("Unique", ["x"], ["y"])
    audit = onnx_op_audit(hand_made(tmp_path / "unique.onnx", [unique]))
    assert audit["portable"] is False and audit["not_portable"][0]["op"] == "Unique"
    # A Relu in another domain is not the ONNX one.
    custom = helper.make_node("Relu", ["x"], ["y"], domain="com.example")
    imports = [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    audit = onnx_op_audit(hand_made(tmp_path / "custom.onnx", [custom], imports))
    assert audit["ops"] == {"com.example::Relu": 1} and audit["portable"] is False


def test_ops_inside_subgraphs_are_audited(tmp_path: Path) -> None:
    out_then = helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])
    out_else = helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])
    then = helper.make_graph([helper.make_node("Unique", ["x"], ["t"])], "then", [], [out_then])
    other = helper.make_graph([helper.make_node("Relu", ["x"], ["e"])], "else", [], [out_else])
    condition = helper.make_node(
        "Constant", [], ["c"], value=helper.make_tensor("c", TensorProto.BOOL, [], [True])
    )
    branch = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
    audit = onnx_op_audit(hand_made(tmp_path / "if.onnx", [condition, branch]))
    assert audit["ops"] == {"Constant": 1, "If": 1, "Unique": 1, "Relu": 1}
    assert audit["portable"] is False


def test_export_json_and_text_carry_the_audit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = vitcompress.compress(timm_small("vit_small_patch16_224", depth=2), "etps", 0.7, [1])
    art = vitcompress.save(model, tmp_path / "art")
    out = tmp_path / "m.onnx"
    args = ["export", "--model", str(art), "--format", "onnx", "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    audit = json.loads(result.stdout)["op_audit"]
    check_audit(out, audit)
    text = CliRunner().invoke(cli, args).stdout
    assert f"ops: {len(audit['ops'])} types" in text
    assert ("portable (TensorRT" in text) is audit["portable"]
    # TorchScript has no ONNX ops to audit.
    pt = CliRunner().invoke(
        cli,
        [
            "export",
            "--model",
            str(art),
            "--format",
            "torchscript",
            "--out",
            str(tmp_path / "m.pt"),
            "--json",
        ],
    )
    assert "op_audit" not in json.loads(pt.stdout)
