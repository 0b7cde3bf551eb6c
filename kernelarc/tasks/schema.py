"""Pydantic models of the SOL-ExecBench problem format (definition.json, workload.jsonl)."""

from __future__ import annotations

import ast
import operator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DTYPES = (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "float4_e2m1", "float4_e2m1fn_x2", "int64", "int32", "int16", "int8", "uint8", "bool",
)  # fmt: skip


class AxisConst(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["const"]
    value: int = Field(description="Constant size of the axis.")
    description: str | None = None


class AxisVar(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["var"]
    description: str | None = None


class AxisExpr(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["expr"]
    expression: str = Field(description="Arithmetic over other axis names: + - * / // % ** ( ).")
    description: str | None = None


Axis = Annotated[AxisConst | AxisVar | AxisExpr, Field(discriminator="type")]


class TensorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shape: list[str | int] | None = Field(description="Axis names (or literal sizes); null means a Python scalar.")
    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    description: str | None = None


class Definition(BaseModel):
    """definition.json: what to compute, with a PyTorch reference defining ``run``."""

    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    axes: dict[str, Axis]
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    reference: str = Field(description="PyTorch source defining run(*inputs).")
    custom_inputs_entrypoint: str | None = None
    constraints: list[str] | None = None
    hf_id: str | None = None

    @model_validator(mode="after")
    def _check(self) -> Definition:
        names = set(self.axes)
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            for tname, spec in specs.items():
                for ax in spec.shape or []:
                    if not is_literal_dim(ax) and ax not in names:
                        raise ValueError(f"{kind}.{tname}.shape names unknown axis {ax!r} (axes: {sorted(names)})")
        for aname, ax in self.axes.items():
            if isinstance(ax, AxisExpr):
                free = expr_names(ax.expression)
                if not free <= names - {aname}:
                    raise ValueError(f"axes.{aname}.expression uses unknown axes {sorted(free - names)}")
        for c in self.constraints or []:
            free = expr_names(c)
            if not free <= names:
                raise ValueError(f"constraints: {c!r} uses unknown axes {sorted(free - names)}")
        if "def run" not in self.reference:
            raise ValueError("reference must define a function run(...)")
        if self.custom_inputs_entrypoint and f"def {self.custom_inputs_entrypoint}" not in self.reference:
            raise ValueError(f"custom_inputs_entrypoint {self.custom_inputs_entrypoint!r} is not defined in reference")
        return self


class InputRandom(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["random"]


class InputScalar(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["scalar"]
    value: int | float | bool


class InputSafetensors(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["safetensors"]
    path: str = Field(description="Path of the .safetensors file, relative to the problem folder.")
    tensor_key: str


class InputCustom(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"]


InputDescriptor = Annotated[InputRandom | InputScalar | InputSafetensors | InputCustom, Field(discriminator="type")]


class Tolerance(BaseModel):
    """A workload's correctness bounds, as NVIDIA's ToleranceSpec has them (unset fields take its defaults).

    Unknown keys are kept (``model_extra``) and ignored, as the harness ignores them (pydantic's default
    there); the loader warns about them, e.g. the misspelt ``required_match_ratio`` of real data.
    """

    model_config = ConfigDict(extra="allow")
    max_atol: float | None = None
    max_rtol: float | None = None
    required_matched_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    max_error_cap: float | None = Field(default=None, description="Hard ceiling on any absolute error.")
    allow_negative_inf: bool | None = Field(default=None, description="Positions -inf in both pass.")


class Workload(BaseModel):
    """One line of workload.jsonl: values for the var axes and the source of each input."""

    model_config = ConfigDict(extra="allow")
    uuid: str
    axes: dict[str, int]
    inputs: dict[str, InputDescriptor]
    tolerance: Tolerance | None = None


def is_literal_dim(ax: str | int) -> bool:
    """Real data sometimes writes a literal size (e.g. "1") in a shape instead of an axis name."""
    return isinstance(ax, int) or (isinstance(ax, str) and ax.isdigit())


# --- safe arithmetic over axis names --------------------------------------------------

_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_CMPOPS = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
}  # fmt: skip


def expr_names(expr: str) -> set[str]:
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse expression {expr!r}: {e.msg}") from None
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def eval_expr(expr: str, env: dict[str, Any]) -> Any:
    """Evaluate arithmetic/comparison over names in ``env``; nothing else is allowed."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in env:
                raise ValueError(f"unknown axis {node.id!r} in {expr!r}")
            return env[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.Compare) and all(type(o) in _CMPOPS for o in node.ops):
            left = ev(node.left)
            for op, right_node in zip(node.ops, node.comparators, strict=True):
                right = ev(right_node)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.BoolOp):
            vals = [ev(v) for v in node.values]
            return all(vals) if isinstance(node.op, ast.And) else any(vals)
        raise ValueError(f"unsupported syntax in expression {expr!r}")

    return ev(ast.parse(expr, mode="eval"))
