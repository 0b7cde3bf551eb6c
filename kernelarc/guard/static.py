"""Static checks on candidate source, before anything runs.

Structural rules rather than a list of spellings: a kernel computes with torch / triton /
CUTLASS and has no business reaching the interpreter's internals, so the checks reject

* imports of any module outside a short allow-list (``ALLOWED_IMPORT_ROOTS``: torch, triton, CUTLASS and the
  computational standard library), and, inside it, of modules that reach the harness or the OS (``sys``, ``gc``,
  ``inspect``, ``ctypes``, ``importlib``, ``subprocess``, ``threading``, payload decoders such as ``base64`` /
  ``zlib`` / ``codecs``, name resolvers such as ``pkgutil`` / ``pydoc`` / ``unittest.mock``, ...), however spelt:
  ``import sys``, ``from os import sys``, ``os.sys``, ``torch.multiprocessing`` as an attribute, and a dotted
  or ``module:attr`` string that names one of them or a forbidden attribute (``"sys:_getframe"``: what a
  resolver would turn into the object);
* any dunder attribute outside a short list of ordinary ones (``__self__``, ``__globals__``,
  ``__code__``, ``__builtins__``, ``__subclasses__``, ``__class__``, ``__dict__``, ...), and frame /
  traceback / generator internals (``f_back``, ``tb_frame``, ``gi_frame``, ``_getframe``);
* dynamic code and dynamic names: ``exec`` / ``eval`` / ``compile`` / ``__import__`` /
  ``globals`` / ``vars`` / ``locals``, ``getattr`` / ``hasattr`` / ``operator.attrgetter`` /
  ``methodcaller`` with a computed name or a forbidden one, and string literals that spell a
  forbidden attribute (how a name is smuggled past the other rules);
* a chain of attributes (or a getattr with a constant name) rooted at an import that reaches, on the real modules,
  one a candidate may not import, the builtins module, an os function outside OS_ALLOWED_ATTRS or a dynamic
  builtin: a library's own imports are attributes of it (``torch.os``, ``random._os``, ``enum.bltns``);
* assignments to attributes of imported modules (monkey-patching), however the module was bound,
  also through a name bound to something reached from one (``_R = random.Random``);
* the dynamic builtins (``getattr``, ``setattr``, ``eval``, ...) used as values (``_ga = getattr``),
  which would hide their calls from the rules above.

Module-level state through ``global`` is allowed (class 9 of issue 15): whether a kernel caches
results is decided by behaviour (fresh and rewritten inputs must give fresh answers), not by
syntax. The guard's runtime checks catch what slips through.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import os
import re
import types
from dataclasses import dataclass
from typing import Any

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
    "pydantic": "patches the harness's messages",
    "pdb": "debugger: frames and trace hooks",
    "bdb": "debugger: frames and trace hooks",
    "marshal": "arbitrary code",
    "time": "can patch or read timers",
    "base64": "decodes hidden payloads",
    "binascii": "decodes hidden payloads",
    "codecs": "decodes hidden payloads",
    "zlib": "decodes hidden payloads",
    "lzma": "decodes hidden payloads",
    "bz2": "decodes hidden payloads",
    "operator": "attrgetter/methodcaller reach attributes by computed names",
    "traceback": "reads frames",
    "weakref": "reaches objects the kernel was not given",
    "resource": "changes process limits",
    "pty": "starts processes",
    "shutil": "file system access",
    "pathlib": "file system access",
    "io": "file I/O",
    "runpy": "executes code",
    "code": "executes code",
    "types": "builds code and frames",
    "timeit": "timing",
    "datetime": "reads the clock (the gaps between calls tell a checked call's set-up from the others')",
    "sys": "can reach the harness through sys.modules/frames",
    "torch.multiprocessing": "starts processes",
    "torch.cuda.nvtx": "profiler ranges",
    # name resolvers: "sys:_getframe" as data becomes the object, past every rule on names (a red team's
    # pkgutil.resolve_name reached the timer's frame and forged its samples)
    "pkgutil": "resolves names given as strings to any module or attribute",
    "pydoc": "resolves names given as strings to any module or attribute",
    "unittest": "mock.patch resolves and patches names given as strings",
    "logging.config": "resolves names given as strings (ext://)",
    "zipimport": "dynamic imports",
    "copyreg": "pickling machinery: arbitrary calls",
    "shelve": "arbitrary deserialization",
    "dill": "arbitrary deserialization",
    "cloudpickle": "arbitrary deserialization",
    "torch.utils.cpp_extension": "compiles C++ into the worker (raw memory access)",
    "torch.package": "imports and deserializes arbitrary code",
    # a fourth red team: names a candidate gives go into code these execute (torch.fx.Graph().placeholder("x=...")
    # was exec'd inside GraphModule, from torch's frame)
    "torch.fx": "generates and executes Python code from the names it is given",
    "dataclasses": "executes generated code with the field names it is given",
    # a thirty-third red team: torch.utils.benchmark.Timer compiles and runs its setup/stmt text (timeit's exec, from
    # timeit's own file-based frames)
    "torch.utils.benchmark": "compiles and runs the Python text it is given (timeit), and times",
    # ... torch.load(weights_only=False) unpickled bytes a candidate wrote (UntypedStorage.from_file): exec from torch's
    # frame; torch.hub loads and unpickles files
    "torch.serialization": "unpickles arbitrary objects (torch.load) and writes files (torch.save)",
    "torch.hub": "downloads, writes and unpickles files",
    # Triton's own builders compile and load the C they are given, under Triton's frames (which the runtime audit
    # trusts as a compiler's): a kernel uses triton, triton.language, triton.testing, triton.tools.tensor_descriptor
    "triton.runtime.build": "compiles and loads the C code it is given",
    "triton.backends": "the drivers' builders compile and load C code (launchers, utilities)",
    "triton.compiler": "compiles and loads code it is given (call triton.jit kernels instead)",
    "triton._C": "Triton's native bindings",
    "triton.runtime.cache": "writes files (the kernel cache)",
    "triton.tools.compile": "compiles kernels ahead of time into C sources",
    "triton.tools.link": "writes C sources",
    "triton.tools.disasm": "starts processes",
}
# torch's private modules (torch._*) are its internals: torch._inductor.codecache.PyCodeCache.load(text) wrote a red
# team's text to a file and imported it as a module (code with a file of its own, past the runtime audit). A
# candidate may use the compilers' packages and their configuration (torch._inductor.config, as graph strategies and
# exported solutions set it), and torch's private functions (torch._scaled_mm, torch._grouped_mm), nothing else.
PRIVATE_TORCH_ALLOWED = frozenset({"torch._dynamo", "torch._inductor", "torch._functorch", "torch._dynamo.config",
                                   "torch._inductor.config", "torch._functorch.config"})  # fmt: skip
ALLOWED_KERNELARC = {"kernelarc.cutlass"}  # the trusted CUTLASS build helper (kernelarc/cutlass.py)
# The only top-level modules a candidate may import (the rules above still hold inside them: torch.multiprocessing,
# os.system, ...). A kernel computes with torch, Triton or CUTLASS and the plain computational standard library;
# every other module is refused by default, so that one nobody listed above (a resolver, a hidden eval, a clock, raw
# memory) is refused before anyone finds it: the list of bans had been extended after each red team (pkgutil, pydoc,
# unittest.mock, datetime), and the standard library holds more of the kind (mmap, atexit, faulthandler, ast, dis).
# SOL-ExecBench's references import torch, torch.nn.functional, math, enum and typing; NVIDIA's example solutions
# torch, triton and math; KernelArc's families emit torch, triton, math and os. Not numpy (its ctypeslib and memmap
# reach raw memory and files) nor the cutlass Python package (raw device copies; CUTLASS candidates are C++ built by
# kernelarc.cutlass).
# What a candidate may use of os (a kernel reads its environment): os.write on the worker's socket would forge the
# harness's replies, os.open("/proc/self/mem") would patch the worker's own memory.
OS_ALLOWED_ATTRS = frozenset({"environ", "getenv", "path", "cpu_count", "sched_getaffinity", "sep", "linesep",
                              "pathsep", "name", "curdir"})  # fmt: skip
_OS_WORDS = "of os a candidate may use " + ", ".join(sorted(OS_ALLOWED_ATTRS))
ALLOWED_IMPORT_ROOTS = frozenset({
    "torch", "triton", "einops", "kernelarc", "__future__",
    "math", "cmath", "numbers", "fractions", "decimal", "statistics", "random",
    "functools", "itertools", "collections", "heapq", "bisect", "array", "copy",
    "typing", "typing_extensions", "enum", "abc", "contextlib", "warnings",
    "re", "string", "struct", "textwrap", "hashlib", "json", "os",
})  # fmt: skip
BANNED_CALLS = {
    "exec": "executes generated code",
    "eval": "executes generated code",
    "compile": "executes generated code",
    "__import__": "dynamic imports",
    "setattr": "patches objects",
    "delattr": "patches objects",
    "globals": "reads module state",
    "vars": "reads module state",
    "locals": "reads frame state",
    "memoryview": "raw memory access",
    "breakpoint": "debugger",
    "open": "file I/O",
    "input": "reads stdin",
}
_CLOCKS = ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time", "thread_time",
           "clock_gettime", "clock_gettime_ns", "times", "uuid1")  # fmt: skip
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
    "currentframe": "reads the judge's frames",
    "f_back": "reads the judge's frames",
    "f_globals": "reads the judge's frames",
    "f_locals": "reads the judge's frames",
    "f_code": "reads the judge's frames",
    "f_builtins": "reads the judge's frames",
    "tb_frame": "reads the judge's frames",
    "tb_next": "reads the judge's frames",
    "gi_frame": "reads frames",
    "cr_frame": "reads frames",
    "ag_frame": "reads frames",
    "settrace": "installs a trace hook",
    "setprofile": "installs a profile hook",
    "addaudithook": "installs an audit hook",
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
    # name resolvers and hidden evals inside allowed modules (a second red team: torch._utils._import_dotted_name,
    # string.Formatter().get_field, typing.get_type_hints on string annotations)
    "_import_dotted_name": "resolves names given as strings",
    "import_module": "dynamic imports",
    "get_field": "resolves dotted names given as strings",
    "get_type_hints": "evaluates string annotations (a hidden eval)",
    "ForwardRef": "evaluates strings (a hidden eval)",
    "_eval_type": "evaluates strings (a hidden eval)",
    "_forward_from_src": "executes generated code",
    # annotations evaluated as code (typing.get_type_hints inside them): a fourth red team ran a payload from a
    # string annotation through functools.singledispatch.register, and from a field name through dataclasses
    "singledispatch": "evaluates string annotations (a hidden eval)",
    "singledispatchmethod": "evaluates string annotations (a hidden eval)",
    "make_dataclass": "executes generated code with the field names it is given",
    "__annotations__": "annotations given as data are evaluated as code by typing and dataclasses",
    # attributes of library modules and objects that hold modules a candidate may not use (random._os,
    # collections._sys, enum.bltns, warnings.catch_warnings()._module): reached through an instance or a wrapped
    # module, past the walk of chains rooted at an import
    **dict.fromkeys(
        (
            "_os",
            "_sys",
            "bltns",
            "_builtins",
            "_module",
            "_imp",
            "_io",
            "_thread",
            "_weakref",
            "_posix",
            "posix",
            "_signal",
            "_socket",
        ),
        "holds a module a candidate may not use",
    ),
    # clocks: the gap between two calls tells a checked call's set-up (a copy) from an unchecked one's (a draw); a
    # red team skipped the work on calls after a long gap (datetime.now())
    **dict.fromkeys(_CLOCKS, "reads the clock"),
    # torch.UntypedStorage.from_file / torch.from_file map a file into a tensor: a candidate's writes land in a file
    # (a red team wrote a pickle for torch.load to run) with no open() the runtime audit would see
    "from_file": "maps a file into memory (writes files unseen)",
    # the compilers' configuration as a whole (its string settings reach compilers' command lines)
    "patch": "changes a module's settings (the compilers' configuration) for a while",
    # loaders of native code or compiled packages from files, and Triton's launcher builder (its signature's types go
    # into C source that Triton's frames compile and load)
    "load_library": "loads a shared library into the worker",
    "aoti_load_package": "loads a compiled package (native code) from a file",
    "launcher_cls": "builds and loads a C launcher from what it is given",
    "compile_module_from_src": "compiles and loads the C code it is given",
    "set_num_threads": "takes more CPU threads than the worker's share",
    "set_num_interop_threads": "takes more CPU threads than the worker's share",
    "sched_setaffinity": "takes CPUs outside the worker's share",
    "posix_spawn": "starts processes",
    "posix_spawnp": "starts processes",
    "register_at_fork": "runs code in forked processes",
    **{f"spawn{x}": "starts processes" for x in ("l", "le", "lp", "lpe", "ve", "vp", "vpe")},
    **{f"exec{x}": "replaces the process" for x in ("l", "le", "lp", "lpe", "vp", "vpe")},
}
# Module roots whose attributes a candidate may not assign to (monkey-patching); names bound by the
# candidate's own import statements are added per source.
PROTECTED_ROOTS = {"torch", "triton", "tl", "os", "sys", "time", "math", "numpy", "np", "builtins", "F"}
# The dunder attributes ordinary code uses; every other one reaches interpreter internals.
ALLOWED_DUNDERS = {
    "__init__", "__name__", "__qualname__", "__doc__", "__len__", "__getitem__", "__setitem__", "__call__",
    "__enter__", "__exit__", "__iter__", "__next__", "__repr__", "__str__", "__eq__", "__hash__", "__contains__",
    "__version__", "__post_init__",
}  # fmt: skip
# The special methods a candidate's own classes may define. Any other one is code Python or the harness runs on the
# candidate's objects outside the call that made them (a red team's list subclass computed its result in ``__iter__``,
# which the harness ran while reading the result, after the clock; ``__del__`` runs when the harness drops a value;
# a thirty-fourth red team's result dict had a key whose ``__hash__`` did the work when the harness copied the dict).
# No candidate KernelArc writes (families, graph rewrites) defines ``__hash__`` or ``__eq__``.
CLASS_DUNDERS = {"__init__", "__call__", "__repr__", "__str__", "__enter__", "__exit__", "__post_init__"}
# class attributes that are data, not code Python calls
_CLASS_DATA_DUNDERS = {"__slots__", "__doc__", "__module__", "__qualname__"}
# Modules reachable as attributes of other modules (os.sys, torch.multiprocessing, ...).
# (not the names ordinary code reaches as attributes: torch._inductor.config, a dataclass's .config, .package)
# (torch.backends.cudnn.benchmark is a flag: torch.utils.benchmark is caught by the walk of attribute chains)
_MODULE_ATTRS = {m.split(".")[-1] for m in BANNED_MODULES} - {"time", "code", "io", "types", "operator", "signal",
                                                              "config", "package", "mock", "benchmark",
                                                              # Triton's builders: ordinary words (torch.compile,
                                                              # torch._C), their modules refused by identity
                                                              "build", "backends", "compiler", "_C", "cache",
                                                              "compile", "link", "disasm"}  # fmt: skip


def allowed_imports() -> str:
    """The top-level modules a candidate may import, as one line (the static check's message and the agents'
    rules)."""
    return ", ".join(sorted(ALLOWED_IMPORT_ROOTS - {"__future__", "kernelarc"})) + " (and kernelarc.cutlass)"


@dataclass(frozen=True)
class StaticReport:
    syntax_error: str | None
    violations: tuple[str, ...]  # what reaches past the harness: rejected as a hack
    has_run: bool
    refused: tuple[str, ...] = ()  # imports outside the allow-list: not evidence of a hack, a candidate that cannot run

    @property
    def ok(self) -> bool:
        return self.syntax_error is None and not self.violations and not self.refused and self.has_run


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _forbidden_attr(name: str) -> str | None:
    if name in BANNED_ATTRS:
        return BANNED_ATTRS[name]
    if name.startswith("__") and name.endswith("__") and name not in ALLOWED_DUNDERS:
        return "dunder attributes reach interpreter internals"
    return None


def check_source(source: str, *, allow_modules: frozenset[str] = frozenset()) -> StaticReport:
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return StaticReport(f"SyntaxError line {e.lineno}: {e.msg}", (), False)
    found: list[str] = []
    refused: list[str] = []

    def flag(node: ast.AST, msg: str) -> None:
        found.append(f"line {getattr(node, 'lineno', '?')}: {msg}")

    def banned_module(name: str) -> str | None:
        for banned, why in BANNED_MODULES.items():
            if (name == banned or name.startswith(banned + ".")) and banned not in allow_modules:
                return why
        return _private_module(name) if "torch._" not in allow_modules else None

    # Every name an import statement binds is a module (or a module's member): never assigned into. Nor is a name
    # bound to something reached from one (``_R = random.Random; _R.randrange = spy`` patched the harness's
    # random source through an alias), to the fixpoint of such bindings.
    protected = set(PROTECTED_ROOTS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            protected |= {(a.asname or a.name).split(".")[0] for a in node.names}
    bindings = _bindings(tree)
    grown = True
    while grown:
        grown = False
        for name, value in bindings:
            if name not in protected and _root_name(value) in protected:
                protected.add(name)
                grown = True

    # what each name bound by an import (or to a chain of attributes rooted at one) stands for, as (module, attrs):
    # every chain of attributes on it is walked on the real modules (``_resolve_chain``)
    origin: dict[str, tuple[str, list[str]]] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                origin[a.asname or a.name.split(".")[0]] = (a.name if a.asname else a.name.split(".")[0], [])
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            for a in n.names:
                origin[a.asname or a.name] = (n.module, [a.name])
    grown = True
    while grown:
        grown = False
        for name, value in bindings:
            chain = _chain(value)
            if name not in origin and chain and chain[0] in origin and name != chain[0]:
                mod, attrs = origin[chain[0]]
                origin[name] = (mod, attrs + chain[1:])
                grown = True
    reached: dict[str, str | None] = {}

    def reaches(root: str, attrs: list[str]) -> str | None:
        mod, pre = origin[root]
        key = ".".join([mod, *pre, *attrs])
        if key not in reached:
            reached[key] = None
            if not banned_module(mod) and not _module_allowed(mod, banned_module, allow_modules):
                try:
                    start = importlib.import_module(mod)
                except Exception:  # noqa: BLE001 - a module the judge lacks: nothing to walk
                    start = None
                if start is not None:
                    reached[key] = _resolve_chain(start, [*pre, *attrs], banned_module, allow_modules)
        return reached[key]

    for n in ast.walk(tree):
        chain = _chain(n) if isinstance(n, ast.Attribute) else None
        if isinstance(n, ast.Call) and _callee(n) in ("getattr", "hasattr") and len(n.args) >= 2:
            base, attr = _chain(n.args[0]), n.args[1]
            if base and isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                chain = [*base, attr.value]
        if isinstance(n, ast.ImportFrom) and n.module and not n.level:
            for a in n.names:
                if a.name != "*" and (why := reaches(a.asname or a.name, [])):
                    flag(n, f"imports {n.module}.{a.name}, which reaches {why}")
            continue
        if chain and chain[0] in origin and len(chain) > 1 and (why := reaches(chain[0], chain[1:])):
            flag(n, f"uses {'.'.join(chain)}, which reaches {why}")
    # A module a candidate imports is used as the base of attributes (or getattr's object) only: as a value
    # ([enum][0].bltns, (lambda: os)().write) it would carry any attribute past the walk of chains above.
    modules = {name for name, (mod, attrs) in origin.items() if not attrs}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and not n.level:
            for a in n.names:
                with contextlib.suppress(Exception):  # a module the judge lacks: nothing to tell
                    if isinstance(getattr(importlib.import_module(n.module), a.name, None), types.ModuleType):
                        modules.add(a.asname or a.name)
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in modules:
            up = parents.get(n)
            base = isinstance(up, ast.Attribute) and up.value is n
            base = base or isinstance(up, ast.Call) and _callee(up) in ("getattr", "hasattr") and up.args[:1] == [n]
            if not base:
                flag(n, f"uses the module {n.id} as a value (a module is the base of its attributes only)")
    called = {n.func for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    # names the source binds itself (``def run(input)``): not the builtins of the same name
    bound = {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    bound |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store | ast.Del)}
    bound |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    bound |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
              for a in n.names}  # fmt: skip
    # ... except the dynamic builtins: ``def _pick(getattr=getattr)`` exempted every bare getattr of the file (a
    # second red team), so a binding of one of them is flagged itself
    for name in sorted(bound & _NEVER_REBOUND):
        found.append(f"binds the name {name} (hides the builtin's calls from these checks)")
    bound -= _NEVER_REBOUND
    has_run = False
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "run" and node in tree.body:
            has_run = True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "run" for t in node.targets):
            has_run = True
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom):
                # `from os import sys`: the member may itself be a module that is not allowed.
                names += [f"{node.module}.{a.name}" for a in node.names] + [a.name for a in node.names]
            for name in names:
                why = banned_module(name)
                if why:
                    flag(node, f"imports {name} ({why})")
            if isinstance(node, ast.ImportFrom):
                for a in node.names:  # a name imported is an attribute reached (from torch._utils import ...)
                    if why := _forbidden_attr(a.name):
                        flag(node, f"imports {a.name} from {node.module} ({why})")
            if isinstance(node, ast.ImportFrom) and node.level:
                refused.append(f"line {node.lineno}: a relative import (a candidate is one self-contained file)")
            for name in names[:1] if isinstance(node, ast.ImportFrom) else names:
                root = name.split(".")[0]
                if root and root not in ALLOWED_IMPORT_ROOTS and root not in allow_modules and not banned_module(name):
                    refused.append(f"line {node.lineno}: imports {name} (not among the modules a candidate may "
                                   f"import: {allowed_imports()})")  # fmt: skip
            # KernelArc's own modules are the harness; candidates may use only the CUTLASS build helper.
            own = [n for n in names if n == "kernelarc" or n.startswith("kernelarc.")]
            if isinstance(node, ast.ImportFrom) and node.module == "kernelarc":
                own = [f"kernelarc.{a.name}" for a in node.names]
            for name in own:
                allowed = any(name == a or name.startswith(a + ".") for a in ALLOWED_KERNELARC)
                if not allowed and "kernelarc" not in allow_modules:
                    flag(node, f"imports {name} (reaches into the harness; only kernelarc.cutlass is allowed)")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                names: list[str] = []
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names = [item.name]
                elif isinstance(item, ast.Assign | ast.AnnAssign | ast.AugAssign):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                    names = [n for n in names if n not in _CLASS_DATA_DUNDERS]
                for name in names:
                    if name.startswith("__") and name.endswith("__") and name not in CLASS_DUNDERS:
                        flag(item, f"class {node.name} defines {name} (a special method the interpreter or the harness "
                                   f"calls outside the candidate's call: when it reads a result, drops a value, ...; a "
                                   f"class may define only {', '.join(sorted(CLASS_DUNDERS))})")  # fmt: skip
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BANNED_CALLS:
            flag(node, f"calls {node.func.id}() ({BANNED_CALLS[node.func.id]})")
        elif isinstance(node, ast.Call) and any(
            k.arg == "weights_only" and not (isinstance(k.value, ast.Constant) and k.value.value is True)
            for k in node.keywords
        ):
            flag(node, "passes weights_only other than True (torch.load would unpickle arbitrary objects: code)")
        elif isinstance(node, ast.Call) and _callee(node) == "type" and len(node.args) == 3:
            # type(name, bases, namespace) names its methods as data: a "__del__" spelt in pieces ran untimed work
            flag(node, "builds a class with type(name, bases, dict) (hides its dunder methods from these checks)")
        elif isinstance(node, ast.Call) and _callee(node) in ("getattr", "hasattr", "attrgetter", "methodcaller"):
            fname = _callee(node)
            args = node.args[1:2] if fname in ("getattr", "hasattr") else node.args[:1]
            if fname in ("attrgetter", "methodcaller"):
                args = node.args
            for name in args:
                if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                    flag(node, f"{fname}() with a computed name (hides attribute access from these checks)")
                    continue
                for part in name.value.split("."):
                    why = _forbidden_attr(part)
                    if why:
                        flag(node, f"{fname}(..., {name.value!r}) ({why})")
        elif isinstance(node, ast.Attribute):
            why = _forbidden_attr(node.attr)
            if why:
                flag(node, f"uses .{node.attr} ({why})")
            elif node.attr in _MODULE_ATTRS and node.attr not in allow_modules:
                flag(node, f"uses .{node.attr} (reaches a module that is not allowed through another module)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            # A forbidden attribute spelt as data is one about to be reached by a computed name.
            if (_forbidden_attr(node.value) and (node.value.startswith("__") or node.value in _FRAME_ATTRS)
                    and node.value not in _HARMLESS_STRINGS):  # fmt: skip
                flag(node, f"string {node.value!r} names a forbidden attribute")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.match(node.value):
            # "sys:_getframe", "inspect.currentframe": a module or attribute spelt for a resolver to reach
            why = _names_forbidden(node.value, banned_module)
            if why:
                flag(node, f"string {node.value!r} names {why}")
        elif isinstance(node, ast.Name) and node.id in ("__builtins__", "__loader__", "__spec__", "__import__",
                                                        "__annotations__"):  # fmt: skip
            flag(node, f"uses {node.id}")
        elif isinstance(node, ast.Name) and node.id in _DYNAMIC and node not in called and node.id not in bound:
            # ``_ga = getattr`` then ``_ga(frame, "f_" + "back")``: the call rules above see only direct calls
            flag(node, f"uses {node.id} as a value (hides the calls these checks look at)")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "environ"
            and node.func.attr != "get"
        ):
            flag(node, f"calls environ.{node.func.attr}() (changes the environment)")
        if isinstance(node, ast.Call):
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                # a function given the environment itself (MutableMapping.update(os.environ, ...): a red team's flags
                # for the compilers that a torch.compile and a CUTLASS build then ran)
                if isinstance(arg, ast.Attribute) and arg.attr == "environ":
                    flag(node, "passes the environment to a function (changes it past these checks)")
            compiles = _callee(node) in ("compile", "optimize") and _root_name(node.func) != "re"
            # (also any call given options= or backend=: torch.compile under another name)
            for why in _compile_settings(node, every=compiles):
                flag(node, why)
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple | ast.List) else [t]:
                    if isinstance(el, ast.Attribute | ast.Subscript) and _root_name(el) in protected:
                        flag(node, f"assigns to {ast.unparse(el)} (monkey-patching a library)")
    return StaticReport(None, tuple(found), has_run, tuple(refused))


# Builtins whose calls the checks inspect: a candidate may call them directly, never pass or bind them.
_DYNAMIC = set(BANNED_CALLS) | {"getattr", "hasattr"}
# ... and those whose name the source may not bind at all (``input``, ``open`` are ordinary parameter names)
_NEVER_REBOUND = {"getattr", "hasattr", "setattr", "delattr", "eval", "exec", "__import__", "globals", "vars", "locals"}


def _bindings(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """(name, value) for every plain name binding whose value is an expression: assignments (also tuple targets
    paired element by element), annotated and walrus assignments, ``for`` targets and ``with ... as``."""
    out: list[tuple[str, ast.AST]] = []

    def pair(target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Name):
            out.append((target.id, value))
        elif isinstance(target, ast.Tuple | ast.List):
            vals = (
                value.elts if isinstance(value, ast.Tuple | ast.List) and len(value.elts) == len(target.elts) else None
            )
            for i, el in enumerate(target.elts):
                pair(el, vals[i] if vals is not None else value)
        elif isinstance(target, ast.Starred):
            pair(target.value, value)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                pair(t, node.value)
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
            pair(node.target, node.value)
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
            pair(node.target, node.iter)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            pair(node.optional_vars, node.context_expr)
    return out


# dunder strings ordinary code spells: ``if __name__ == "__main__":`` (a reference's own test block)
_HARMLESS_STRINGS = {"__main__"}
# attributes whose names are ordinary words in a dotted string ("timing.times", "cuda.synchronize" in a message)
_HARMLESS_IN_STRINGS = {*_CLOCKS, "synchronize", "Stream", "ExternalStream", "set_stream", "elapsed_time", "do_bench",
                        "_C", "set_num_threads", "set_num_interop_threads", *_HARMLESS_STRINGS}  # fmt: skip
_DOTTED = re.compile(r"^[A-Za-z_][\w]*(?:[.:][A-Za-z_][\w]*)+$")


def _names_forbidden(text: str, banned_module) -> str | None:
    """What a dotted or ``module:attr`` string names that the rules forbid: a banned module (its name or a prefix
    of it, "sys.modules", "unittest.mock"), the harness ("kernelarc.guard.timer"), or a forbidden attribute anywhere
    in it ("os:_exit", "x.f_back", "f.__code__")."""
    mod, _, attr = text.partition(":")
    parts = mod.split(".")
    for i in range(len(parts), 0, -1):
        why = banned_module(".".join(parts[:i]))
        if why:
            return f"module {'.'.join(parts[:i])} ({why})"
    if parts[0] == "kernelarc" and not any(mod == a or mod.startswith(a + ".") for a in ALLOWED_KERNELARC):
        return f"module {mod} (the harness)"
    for part in [*parts[1:], *attr.split(".")]:
        if part in _HARMLESS_IN_STRINGS:
            continue
        why = _forbidden_attr(part)
        if why or part in _FRAME_ATTRS:
            return f"attribute {part} ({why or 'reads frames'})"
    return None


_FRAME_ATTRS = {"_getframe", "f_back", "f_globals", "f_locals", "f_code", "f_builtins", "tb_frame", "tb_next",
                "gi_frame", "cr_frame", "ag_frame", "modules", "settrace", "setprofile"}  # fmt: skip


# builtins a chain of attributes may not end on, whatever module re-exports them (``enum.bltns.exec``)
_DANGEROUS_BUILTINS = {"exec", "eval", "compile", "__import__", "open", "getattr", "setattr", "delattr", "globals",
                       "vars", "locals", "breakpoint", "input", "memoryview"}  # fmt: skip
_DANGEROUS_OBJECTS = tuple(getattr(builtins, n) for n in sorted(_DANGEROUS_BUILTINS))
# what os.path resolves to (a module of another name)
_PATH_MODULES = {"posixpath", "ntpath", "genericpath", "os.path"}


def _private_module(name: str) -> str | None:
    """Why ``name`` is a private torch module a candidate may not use (None: it is not one, or it is allowed):
    ``torch._X...`` outside ``PRIVATE_TORCH_ALLOWED`` (an attribute of an allowed config module is a setting), unless
    a part of it is a function or a class (torch._scaled_mm, torch._dynamo.mark_dynamic) rather than a module."""
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "torch" or not parts[1].startswith("_") or parts[1].startswith("__"):
        return None
    for i in range(len(parts), 1, -1):
        if ".".join(parts[:i]) in PRIVATE_TORCH_ALLOWED:
            if i == len(parts) or parts[i - 1] == "config":
                return None
            break
    obj: Any = importlib.import_module("torch")
    for k, part in enumerate(parts[1:], start=2):
        try:
            obj = inspect_getattr(obj, part)
        except Exception:  # noqa: BLE001 - not loaded in the judge: a module by its name
            break
        if not isinstance(obj, types.ModuleType):
            return None  # a function, class or value of a module: the rules on attributes apply to it
        if ".".join(parts[:k]) not in PRIVATE_TORCH_ALLOWED:
            break
    return "a private torch module: torch's internals (only " + ", ".join(sorted(PRIVATE_TORCH_ALLOWED)) + ")"


def _module_allowed(name: str, banned_module, allow_modules: frozenset[str]) -> str | None:
    """Why a module reached by a chain of attributes is not one a candidate may use (None: it is)."""
    if name in _PATH_MODULES:
        return None
    root = name.split(".")[0]
    if banned_module(name):
        return banned_module(name)
    if name == "builtins" or root not in ALLOWED_IMPORT_ROOTS and root not in allow_modules:
        return "not among the modules a candidate may import"
    if root == "kernelarc" and not any(name == a or name.startswith(a + ".") for a in ALLOWED_KERNELARC):
        return "the harness"
    return None


def _resolve_chain(start: Any, attrs: list[str], banned_module, allow_modules: frozenset[str]) -> str | None:
    """Walk ``start.a.b...`` on the real objects (library modules the judge imports itself) and say what the chain
    reaches that a candidate may not use: a module outside the allow-list or banned (``torch.os``, ``random._os``,
    ``collections._sys``, ``typing.types``, ``torch.serialization.io``: a library's own import of a module is an
    attribute of it), the builtins module (``enum.bltns``), an os function outside OS_ALLOWED_ATTRS, or a dynamic
    builtin (``exec``). An attribute that does not exist on the real object (an instance's, set at run time)
    ends the walk: nothing is known past it."""
    obj = start
    for i, name in enumerate(attrs):
        if obj is os and name not in OS_ALLOWED_ATTRS:  # the os module, imported or reached (torch.os, random._os)
            return f"os.{name} ({_OS_WORDS})"
        try:
            obj = inspect_getattr(obj, name)
        except Exception:  # noqa: BLE001 - not a static attribute: nothing more to tell
            if isinstance(obj, types.ModuleType):
                # a submodule the judge never imported (torch.utils.benchmark), and the rest of the chain below it
                # (torch._inductor.codecache past an allowed torch._inductor the judge never imported either): their
                # names tell as much as the modules
                for k in range(i + 1, len(attrs) + 1):
                    sub = ".".join([obj.__name__, *attrs[i:k]])
                    if why := banned_module(sub) or _private_module(sub):
                        return f"module {sub} ({why})"
            return None
        if isinstance(obj, types.ModuleType):
            mod = obj.__name__
            why = _module_allowed(mod, banned_module, allow_modules)
            if why:
                return f"module {mod} ({why})"
        elif any(obj is b for b in _DANGEROUS_OBJECTS):
            return f"the builtin {getattr(obj, '__name__', name)}"
        elif callable(obj) and getattr(obj, "__module__", None) == "torch.serialization":
            return f"torch.serialization's {getattr(obj, '__name__', name)} (unpickles or writes files)"
    return None


def inspect_getattr(obj: Any, name: str) -> Any:
    """``getattr`` without running a property or a module's lazy ``__getattr__``: the static attribute, or
    AttributeError (the checks never execute a candidate's or a library's code to tell)."""
    if isinstance(obj, types.ModuleType):
        d = object.__getattribute__(obj, "__dict__")
        if name in d:
            return d[name]
        raise AttributeError(name)
    for klass in type.__getattribute__(type(obj), "__mro__") if not isinstance(obj, type) else obj.__mro__:
        d = klass.__dict__
        if name in d:
            v = d[name]
            if isinstance(v, staticmethod | classmethod):
                return v.__func__
            return v
    raise AttributeError(name)


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"] (a name and attributes only), else None."""
    out: list[str] = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(out)]


def _callee(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


# torch.compile's settings a candidate may give (the graph strategies' and exported solutions'): a mode and a backend
# by name, Inductor's options as literal flags and numbers. A red team's string option went into g++'s command line
# ("off -wrapper '/bin/sh,-c,...'"), under Inductor's frames, which the runtime audit trusts.
COMPILE_MODES = frozenset({"default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"})
COMPILE_BACKENDS = frozenset({"inductor", "eager", "aot_eager", "cudagraphs"})


def _compile_settings(node: ast.Call, every: bool = True) -> list[str]:
    """Why a ``torch.compile(...)`` call's settings are refused (empty: they are literal and allowed); ``every``
    False: only its ``options`` and ``backend`` (a call of another name: ``mode`` is an ordinary keyword)."""
    out = []
    for k in node.keywords:
        if not every and k.arg not in ("options", "backend"):
            continue
        v = k.value
        if k.arg == "mode" and not (isinstance(v, ast.Constant) and (v.value is None or v.value in COMPILE_MODES)):
            out.append(f"torch.compile mode other than {', '.join(sorted(COMPILE_MODES))} or None")
        elif k.arg == "backend" and not (isinstance(v, ast.Constant) and v.value in COMPILE_BACKENDS):
            out.append(f"torch.compile backend other than {', '.join(sorted(COMPILE_BACKENDS))}")
        elif k.arg == "options" and not (
            isinstance(v, ast.Dict)
            and all(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in v.keys)
            and all(isinstance(x, ast.Constant) and type(x.value) in (bool, int, float) for x in v.values)
        ):
            out.append("torch.compile options other than a literal dict of flags and numbers (options reach compilers)")
        elif k.arg is None:
            out.append("torch.compile settings passed as **kwargs (hides them from these checks)")
    return out


def calls_torch_compile(source: str) -> bool:
    """Whether the source's code (not its comments or strings) names ``torch.compile``: such a candidate compiles
    with Inductor at its first calls, and its warm-up gets ``guard.compile_timeout_s``. Naming it buys more time for
    the warm-up only, never for the checks and timings after it."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return any(isinstance(n, ast.Attribute) and n.attr == "compile" and _root_name(n) == "torch"
               for n in ast.walk(tree))  # fmt: skip
