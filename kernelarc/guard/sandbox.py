"""The OS boundary between the judge and the workers that run candidate code.

Root (CI, the GPU machine): every worker gets its own unprivileged uid from a high range
(``UID_BASE`` + slot, locked against other judge processes on the machine by an flock; a slot is
reused only after every process of its uid is dead), a group per
role (candidates, trusted: reference, baselines, champion) and its own writable HOME / TMPDIR /
Triton, Inductor and CUTLASS caches. The worker drops to that uid itself, after CUDA is
initialised and the judge's output buffer is mapped, then sets PR_SET_NO_NEW_PRIVS and resource
limits. Another uid cannot signal or ptrace the judge nor open its ``/proc/<pid>/fd/*``; after
every job the judge kills every process of the worker's uid, which catches double-forked daemons
and setsid escapes. Caches are shared per role (group-writable), never between roles: a
candidate cannot plant a compiled kernel in the champion's or the reference's cache.

Not root: the judge makes itself a child subreaper (orphans of a worker come back to it rather
than to init) and non-dumpable (a same-uid worker can then neither ptrace it nor open its
``/proc/<pid>/fd/*``, but can still signal it: said in a log line), and after every job kills
the worker's session, its process group and every process whose environment carries the worker's
token.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from enum import StrEnum

log = logging.getLogger(__name__)

UID_BASE = int(os.environ.get("KERNELARC_UID_BASE", "61000"))
UID_SLOTS = 4096
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
RLIMIT_NPROC = 4096  # threads count too (torch's intra-op pool on a 128-core host)
RLIMIT_FSIZE = 16 << 30  # the largest file a worker may write (a CUTLASS library, a cache entry)


class Role(StrEnum):
    candidate = "candidate"
    trusted = "trusted"  # the reference, its torch.compile baseline, the champion


@dataclass(frozen=True)
class Identity:
    """Who a worker runs as and where it may write."""

    uid: int | None  # None: not root, the worker keeps the judge's uid
    token: str  # in the worker's environment: finds its processes when there is no uid of its own
    tmp: str  # private TMPDIR (the candidate's module files, nvcc's temporaries)

    def role_gid(self, role: Role) -> int | None:
        return None if self.uid is None else UID_BASE - 1 - list(Role).index(role)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def prctl(option: int, arg: int) -> bool:
    libc = _libc()
    return bool(libc is not None and libc.prctl(option, arg, 0, 0, 0) == 0)


PR_SET_KEEPCAPS = 8
PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 47, 2
CAP_DAC_READ_SEARCH = 2


def _others_can_reach(path: str) -> bool:
    """Whether a user with no privileges can traverse every directory above ``path``."""
    p = os.path.realpath(path)
    while True:
        try:
            if not os.stat(p).st_mode & 0o001:
                return False
        except OSError:
            return False
        parent = os.path.dirname(p)
        if parent == p:
            return True
        p = parent


def python_reachable() -> bool:
    """The interpreter, its standard library and every import path are reachable without privileges."""
    import sys

    paths = [sys.prefix, sys.base_prefix, *[x for x in sys.path if x and os.path.isdir(x)]]
    return all(_others_can_reach(x) for x in paths)


def _keep_read_search() -> bool:
    """After the uid drop: keep only CAP_DAC_READ_SEARCH (read and traverse any path), inherited by
    the worker's own tools (gcc, ptxas, nvcc read the interpreter's headers)."""
    libc = _libc()
    if libc is None:
        return False

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    hdr = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    bit = 1 << CAP_DAC_READ_SEARCH
    data = (Data * 2)(Data(bit, bit, bit), Data(0, 0, 0))
    if libc.capset(ctypes.byref(hdr), data) != 0:
        return False
    return libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0) == 0


def _proc_status(pid: str) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def _stat_fields(pid: str) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def find_processes(ident: Identity, leader: int | None, since: int = 0, me: int = -1) -> list[int]:
    """Live processes of a worker; only those started at or after ``since`` (clock ticks after boot,
    the worker's own start) can be, so the others cost one stat read each."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            f = _stat_fields(pid)
            if f[0] == "Z" or int(f[19]) < since:
                continue
            if leader is not None and (int(f[2]) == leader or int(f[3]) == leader):
                found.append(int(pid))  # its process group or its session
                continue
            if ident.uid is not None:
                if int(_proc_status(pid).get("Uid", "-1").split()[0]) == ident.uid:
                    found.append(int(pid))
                continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if f"KERNELARC_WORKER_TOKEN={ident.token}".encode() in fh.read():
                    found.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _own_dir(path: str) -> bool:
    """``path`` exists or was made here, is ours and nobody else can write to it (no planted caches)."""
    with contextlib.suppress(OSError):
        os.makedirs(path, mode=0o711, exist_ok=True)
    try:
        st = os.lstat(path)
    except OSError:
        return False
    import stat

    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


class Sandbox:
    """Judge side: identities for workers, their directories, and the cleanup after a job."""

    def __init__(self) -> None:
        self.root = os.geteuid() == 0 and os.environ.get("KERNELARC_SANDBOX", "1") != "0"
        self.me = os.getpid()
        self._lock = threading.Lock()
        self._free = list(range(UID_SLOTS))
        self._locks: dict[int, int] = {}  # uid -> fd of its lock file
        self.base = tempfile.mkdtemp(prefix="kernelarc-sandbox-")
        os.chmod(self.base, 0o711)  # workers traverse it to their own directories, cannot list it
        self.homes: dict[Role, str] = {}
        # Role homes (Triton, Inductor and CUTLASS caches) persist across sessions where a directory of
        # this user's can be made safely (a first nvcc build takes a minute); else they live with the run.
        persist = os.environ.get("KERNELARC_SANDBOX_HOME") or f"/var/tmp/kernelarc-sandbox-{os.geteuid()}"
        homes_root = persist if _own_dir(persist) else self.base
        for role in Role:
            home = os.path.join(homes_root, f"home-{role.value}")
            os.makedirs(home, exist_ok=True)
            if self.root:
                gid = UID_BASE - 1 - list(Role).index(role)
                os.chown(home, 0, gid)
                os.chmod(home, 0o2770)  # group of the role; new files inherit it (setgid directory)
            self.homes[role] = home
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        if not self.root:
            prctl(PR_SET_DUMPABLE, 0)
            log.warning(
                "guard sandbox: not root, workers run as this user; the judge is a child subreaper and "
                "non-dumpable (no ptrace or /proc/<pid>/fd access by workers) but a worker could still "
                "signal it; stray processes are found by session, process group and an environment token"
            )

    def _claim(self) -> int:
        """A uid no other judge process on this machine uses now: an flock on a per-uid file, held
        while the uid is ours (the kernel drops it if this process dies)."""
        import fcntl

        lock_dir = "/tmp/kernelarc-uids"
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        with self._lock:
            order = self._free[:]
            start = int.from_bytes(os.urandom(2), "little") % max(len(order), 1)
            for slot in order[start:] + order[:start]:
                fd = os.open(os.path.join(lock_dir, str(UID_BASE + slot)), os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                self._free.remove(slot)
                self._locks[UID_BASE + slot] = fd
                return UID_BASE + slot
        raise RuntimeError("no free worker uid slot")

    def allocate(self) -> Identity:
        token = os.urandom(8).hex()
        uid = self._claim() if self.root else None
        tmp = os.path.join(self.base, f"w-{token}")
        os.makedirs(tmp, mode=0o700)
        if uid is not None:
            os.chown(tmp, uid, UID_BASE - 1)
        return Identity(uid, token, tmp)

    def env(self, ident: Identity) -> dict[str, str]:
        return {"KERNELARC_WORKER_TOKEN": ident.token, "TMPDIR": ident.tmp}

    def release(self, ident: Identity, leader: int | None, since: int = 0) -> int:
        """Kill every process of the worker (its uid, or its session / group / token); free the slot."""
        killed = self.kill_all(ident, leader, since)
        shutil.rmtree(ident.tmp, ignore_errors=True)
        if ident.uid is not None:
            if self._processes(ident, leader, since):
                log.error("processes of worker uid %d survived; its slot stays retired", ident.uid)
            else:
                with self._lock:
                    self._free.append(ident.uid - UID_BASE)
                    fd = self._locks.pop(ident.uid, None)
                if fd is not None:
                    os.close(fd)  # the uid is free for any judge again
        return killed

    def _processes(self, ident: Identity, leader: int | None, since: int = 0) -> list[int]:
        return find_processes(ident, leader, since, self.me)

    @staticmethod
    def start_ticks(pid: int) -> int:
        try:
            return int(_stat_fields(str(pid))[19])
        except (OSError, ValueError, IndexError):
            return 0

    def kill_all(self, ident: Identity, leader: int | None, since: int = 0, rounds: int = 50) -> int:
        killed: set[int] = set()
        for r in range(rounds):
            if r:
                time.sleep(0.02)
            pids = self._processes(ident, leader, since)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        self._reap(killed)
        return len(killed)

    def _reap(self, pids: set[int]) -> None:
        # Orphans a worker left came back to this subreaper: collect the ones killed here, by pid only
        # (never waitpid(-1): that would steal the exit status of the caller's own subprocesses).
        for pid in pids:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)

    def close(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


_SANDBOX: Sandbox | None = None
_SANDBOX_LOCK = threading.Lock()


def sandbox() -> Sandbox:
    """The process-wide sandbox (one uid range and one set of role caches per judge process)."""
    global _SANDBOX
    with _SANDBOX_LOCK:
        if _SANDBOX is None:
            _SANDBOX = Sandbox()
            import atexit

            atexit.register(_SANDBOX.close)
        return _SANDBOX


# -- worker side ---------------------------------------------------------------------------
def enter(role: Role, uid: int | None, home: str, tmp: str) -> list[str]:
    """In the worker, before any candidate code exists: private dirs, limits, then the uid drop."""
    import resource

    notes = []
    cache = os.path.join(home, ".cache")
    env = {
        "HOME": home,
        "TMPDIR": tmp,
        "XDG_CACHE_HOME": cache,
        "TRITON_CACHE_DIR": os.path.join(home, ".triton", "cache"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
        "KERNELARC_CUTLASS_CACHE": os.path.join(cache, "kernelarc", "cutlass"),
        "USER": f"kernelarc-{role.value}",
        "LOGNAME": f"kernelarc-{role.value}",
    }
    os.environ.update(env)
    tempfile.tempdir = None  # tempfile caches its choice: take TMPDIR again
    os.umask(0o007)
    for lim, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, RLIMIT_FSIZE)):
        with contextlib.suppress(ValueError, OSError):
            soft, hard = resource.getrlimit(lim)
            v = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(lim, (v, v))
    if uid is not None:
        gid = UID_BASE - 1 - list(Role).index(role)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NPROC, (RLIMIT_NPROC, RLIMIT_NPROC))
        # Where the interpreter lives under a private directory (/root/.pyenv), the worker keeps one
        # capability, reading and traversing any path, so that lazy imports and compilers work; it
        # still cannot write the judge's files, signal it or ptrace it (another uid, no other caps).
        read_all = not python_reachable()
        if read_all:
            prctl(PR_SET_KEEPCAPS, 1)
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        notes.append(f"sandbox: uid {uid} gid {gid}")
        if read_all:
            ok = _keep_read_search()
            notes.append(f"sandbox: interpreter under a private directory; CAP_DAC_READ_SEARCH kept: {ok}")
    if not prctl(PR_SET_NO_NEW_PRIVS, 1):
        notes.append("sandbox: PR_SET_NO_NEW_PRIVS unavailable")
    os.chdir(tmp)
    return notes
