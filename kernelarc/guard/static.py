"""Static checks on candidate source, before anything runs.

The guard's runtime checks catch what slips through; these reject the obvious attempts
to tamper with the harness early and cheaply, with a message saying what was found.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

# Modules a kernel has no business importing: processes, threads, introspection of the
# harness, raw memory access, dynamic imports, I/O channels.
BANNED_MODULES = {
    "threading": "starts threads",
    "_thread": "starts threads",
    "multiprocessing": "starts processes",
    "concurrent": "starts threads or processes",
    "subprocess": "starts processes",
    "asyncio": "runs work outside the call",
    "signal": "tampers with the harness",
    "gc": "can read the judge's objects",
    "inspect": "can read the judge's frames",
    "ctypes": "raw memory access",
    "cffi": "raw memory access",
    "importlib": "dynamic imports",
    "builtins": "patches builtins",
    "socket": "network access",
    "pickle": "arbitrary deserialization",
    "marshal": "arbitrary code",
    "time": "can patch or read timers",
    "timeit": "timing",
    "sys": "can reach the harness through sys.modules/frames",
    "torch.multiprocessing": "starts processes",
    "torch.cuda.nvtx": "profiler ranges",
}
ALLOWED_KERNELARC = {"kernelarc.cutlass"}  # the trusted CUTLASS build helper (kernelarc/cutlass.py)
BANNED_CALLS = {
    "exec": "executes generated code",
    "eval": "executes generated code",
    "compile": "executes generated code",
    "__import__": "dynamic imports",
    "setattr": "patches objects",
    "delattr": "patches objects",
    "globals": "reads module state",
    "vars": "reads module state",
    "breakpoint": "debugger",
    "open": "file I/O",
    "input": "reads stdin",
}
BANNED_ATTRS = {
    "system": "os.system starts processes",
    "fork": "starts processes",
    "forkpty": "starts processes",
    "spawnv": "starts processes",
    "popen": "starts processes",
    "execv": "replaces the process",
    "execve": "replaces the process",
    "kill": "signals processes",
    "_exit": "kills the worker",
    "Stream": "side CUDA streams are not allowed (work must run on the current stream)",
    "ExternalStream": "side CUDA streams are not allowed",
    "set_stream": "switches streams",
    "_getframe": "reads the judge's frames",
    "f_back": "reads the judge's frames",
    "f_globals": "reads the judge's frames",
    "f_locals": "reads the judge's frames",
    "__subclasses__": "reaches arbitrary objects",
    "__globals__": "reaches other modules' state",
    "__builtins__": "patches builtins",
    "modules": "sys.modules reaches the harness",
    "elapsed_time": "reads or patches timers",
    "synchronize": "the harness synchronizes; candidates must not",
    "do_bench": "the harness times; candidates must not",
    "_C": "torch._C internals bypass the harness's view of streams and allocators",
    "__dict__": "reaches module or object state",
    "putenv": "changes the environment",
}
# Module roots whose attributes a candidate may not assign to (monkey-patching).
PROTECTED_ROOTS = {"torch", "triton", "tl", "os", "sys", "time", "math", "numpy", "np", "builtins", "F"}


@dataclass(frozen=True)
class StaticReport:
    syntax_error: str | None
    violations: tuple[str, ...]
    has_run: bool

    @property
    def ok(self) -> bool:
        return self.syntax_error is None and not self.violations and self.has_run


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def check_source(source: str, *, allow_modules: frozenset[str] = frozenset()) -> StaticReport:
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return StaticReport(f"SyntaxError line {e.lineno}: {e.msg}", (), False)
    found: list[str] = []

    def flag(node: ast.AST, msg: str) -> None:
        found.append(f"line {getattr(node, 'lineno', '?')}: {msg}")

    has_run = False
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "run" and node in tree.body:
            has_run = True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "run" for t in node.targets):
            has_run = True
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom):
                names += [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                for banned, why in BANNED_MODULES.items():
                    if (name == banned or name.startswith(banned + ".")) and banned not in allow_modules:
                        flag(node, f"imports {name} ({why})")
            # KernelArc's own modules are the harness; candidates may use only the CUTLASS build helper.
            own = [n for n in names if n == "kernelarc" or n.startswith("kernelarc.")]
            if isinstance(node, ast.ImportFrom) and node.module == "kernelarc":
                own = [f"kernelarc.{a.name}" for a in node.names]
            for name in own:
                allowed = any(name == a or name.startswith(a + ".") for a in ALLOWED_KERNELARC)
                if not allowed and "kernelarc" not in allow_modules:
                    flag(node, f"imports {name} (reaches into the harness; only kernelarc.cutlass is allowed)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BANNED_CALLS:
            flag(node, f"calls {node.func.id}() ({BANNED_CALLS[node.func.id]})")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
        ):
            name = node.args[1]
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                flag(node, f"{node.func.id}() with a computed name (hides attribute access from these checks)")
            elif name.value in BANNED_ATTRS:
                flag(node, f"{node.func.id}(..., {name.value!r}) ({BANNED_ATTRS[name.value]})")
        elif isinstance(node, ast.Attribute) and node.attr in BANNED_ATTRS:
            flag(node, f"uses .{node.attr} ({BANNED_ATTRS[node.attr]})")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "environ"
            and node.func.attr != "get"
        ):
            flag(node, f"calls environ.{node.func.attr}() (changes the environment)")
        elif isinstance(node, ast.Name) and node.id in ("__builtins__", "__loader__", "__spec__"):
            flag(node, f"uses {node.id}")
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute | ast.Subscript) and _root_name(t) in PROTECTED_ROOTS:
                    flag(node, f"assigns to {ast.unparse(t)} (monkey-patching a library)")
        if isinstance(node, ast.Global):
            # A global statement inside run() is how outputs get cached across calls.
            flag(node, f"global statement ({', '.join(node.names)}): state kept across calls")
    return StaticReport(None, tuple(found), has_run)
