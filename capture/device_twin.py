"""A device twin: a block device with a chosen per-I/O latency, bandwidth, largest transfer and
queue depth, built from what this kernel has (loop and FUSE; nbd, ublk, device-mapper and
null_blk are absent), with an ext4 file system on it for the KV chunk files.

Stack, bottom up: a sparse backing file on the real disk; `device_twin_fuse`'s daemon serving it
as one file with the profile's latency model; a loop device in direct-I/O mode (4 KiB sectors)
over that file, whose `queue/max_sectors_kb` is the profile's largest transfer (an NVMe MDTS);
ext4 on the loop device. The block layer, and kvscope's block probes, see `loopN`.

Everything is built and torn down by a supervisor process (`python -m
kvscope.capture.device_twin`), not by the process that wants the twin: the supervisor tears
down when its owner closes the pipe it holds, and a SIGKILLed owner closes it too (the kernel
does), so no loop device, mount or FUSE mount outlives the owner. The supervisor runs in its own
session, so a Ctrl-C meant for the owner's process group does not cut its teardown short. A file
still open on the twin then (a server's child outliving it) defers the end: the mounts are
detached lazily and the loop device clears itself when the file closes. Only a SIGKILL of the
supervisor itself leaves the stack behind (its daemon gets SIGTERM and unmounts FUSE; the loop
device and ext4 mount stay, reading EIO): `losetup -a` and `findmnt` show them.

Limits, measured on the 2-vCPU demo VM (docs/probes.md, "Device twin"): the daemon is Python,
so it costs about one core at its ceiling of ~0.7-1.1 GB/s and ~5-8k requests/s, and the stack
itself takes ~0.12-0.36 ms per read (timed at set-up and left out of the model); a profile
faster than that is not reproduced.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

DEFAULT_SIZE = 8 << 30  # the twin's capacity; sparse, so only what is written uses the disk
READY_TIMEOUT_S = 60.0  # set-up: daemon start, losetup, mkfs and mount of a sparse file
MOUNT_WAIT_S = 10.0  # for the FUSE daemon's mount to appear
CALIBRATION_UNIT = 128 << 10
CALIBRATION_READS = 64  # reads timed to learn the stack's own latency (~20 ms in all)
EXIT_WAIT_S = 10.0  # for a daemon or supervisor to exit once asked
NOT_ROOT = ("a device twin needs root (it attaches a loop device and mounts file systems); "
            "run as root, or read a real disk instead")


class DeviceTwinError(RuntimeError):
    """The twin cannot be built here; the message says why, in one line."""


@dataclass(frozen=True)
class Profile:
    """A device to imitate: per-read latency, bandwidth over all reads in flight, largest
    transfer (the block layer splits larger reads), and the most reads in flight."""

    name: str
    latency_us: float
    bandwidth: float  # bytes/s
    max_sectors_kb: int
    queue_depth: int
    about: str


PROFILES = {p.name: p for p in (
    Profile("nvme-gen4", 80.0, 7e9, 512, 128,
            "local NVMe Gen4: ~80 µs per 128 KiB read, ~7 GB/s with many reads in flight"),
    Profile("nvmeof-tcp", 250.0, 2.5e9, 128, 128,
            "NVMe-oF over TCP: a ~250 µs network round trip, 128 KiB transfers, ~2.5 GB/s"),
    Profile("nvmeof-tcp-x4", 1000.0, 0.625e9, 128, 128,
            "nvmeof-tcp with every time x4: the same serial/parallel ratio, within what the "
            "twin's daemon can serve on a 2-core machine (~1 GB/s)"),
)}


@dataclass(frozen=True)
class Twin:
    """A twin that is up: its block device (e.g. /dev/loop3) and the ext4 mount for KV files."""

    device: str
    mountpoint: str
    profile: Profile
    stack_latency_us: float  # the stack's own time per read, left out of the daemon's model

    @property
    def disk(self) -> str:
        """The name the block probes and /proc/diskstats use (loop3)."""
        return Path(self.device).name


def require_root() -> None:
    if os.geteuid() != 0:
        raise DeviceTwinError(NOT_ROOT)


@contextmanager
def device_twin(profile: Profile, parent: Path, size: int = DEFAULT_SIZE) -> Iterator[Twin]:
    """A twin for the body's duration, its files in a fresh private folder under `parent` (on
    the real disk the backing file should live on).

    Raises:
        DeviceTwinError: not root, or a set-up step failed (nothing is left behind then).
    """
    require_root()
    argv = [sys.executable, "-m", "kvscope.capture.device_twin", profile.name, str(parent),
            "--size", str(size)]
    supervisor = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True)
    try:
        yield _await_ready(supervisor, profile)
    finally:
        _stop(supervisor)


def _await_ready(supervisor: subprocess.Popen[bytes], profile: Profile) -> Twin:
    assert supervisor.stdout is not None and supervisor.stderr is not None
    ready, _, _ = select.select([supervisor.stdout], [], [], READY_TIMEOUT_S)
    line = supervisor.stdout.readline() if ready else b""
    if not line:
        _stop(supervisor)
        problem = supervisor.stderr.read().decode(errors="replace").strip().splitlines()
        raise DeviceTwinError(problem[-1] if problem else "the device twin did not come up")
    state = json.loads(line)
    return Twin(state["device"], state["mountpoint"], profile, state["stack_latency_us"])


def _stop(supervisor: subprocess.Popen[bytes]) -> None:
    """Close the supervisor's pipe (its signal to tear down) and wait for it to finish."""
    if supervisor.stdin is not None and not supervisor.stdin.closed:
        supervisor.stdin.close()
    try:
        supervisor.wait(READY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        supervisor.terminate()
        supervisor.wait(EXIT_WAIT_S)


class _Stack:
    """The supervisor's record of what it built, so teardown undoes exactly that, in reverse."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.backing = folder / "backing"
        self.fuse_dir = folder / "fuse"
        self.kv_dir = folder / "kv"
        self.daemon_log = folder / "daemon.log"  # a file, not a pipe nobody drains
        self.daemon: subprocess.Popen[bytes] | None = None
        self.device: str | None = None
        self.mounted = False

    def build(self, profile: Profile, size: int) -> float:
        """Build the stack; the stack's own latency per read (seconds), which the daemon's
        model leaves out of the profile's so that a read takes what the profile asked."""
        with open(self.backing, "xb") as backing:
            backing.truncate(size)
        self.fuse_dir.mkdir(mode=0o700)
        self.kv_dir.mkdir(mode=0o700)
        self._attach(0.0, profile)
        own_s = self._own_latency_s(profile)
        self._detach()
        self._stop_daemon()
        self._attach(max(0.0, profile.latency_us / 1e6 - own_s), profile)
        _run("mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
             str(self.device))
        _run("mount", "-t", "ext4", str(self.device), str(self.kv_dir))
        self.mounted = True
        return own_s

    def _attach(self, latency_s: float, profile: Profile) -> None:
        """Start the daemon with this latency and the profile's bandwidth and depth, and put
        the tuned loop device over its file."""
        with open(self.daemon_log, "wb") as log:
            self.daemon = subprocess.Popen(
                [sys.executable, "-m", "kvscope.capture.device_twin_fuse", str(self.backing),
                 str(self.fuse_dir), "--latency-us", str(latency_s * 1e6),
                 "--bandwidth", str(profile.bandwidth), "--queue-depth",
                 str(profile.queue_depth)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        self._await_fuse_mount()
        self.device = _run("losetup", "--direct-io=on", "--sector-size", "4096", "--find",
                           "--show", str(self.fuse_dir / "disk"))
        self._tune(profile)

    def _own_latency_s(self, profile: Profile) -> float:
        """The median time of one 128 KiB read (the size profiles state their latency for)
        through the stack with no modelled latency, of the sparse file's holes, so no disk
        time: loop, FUSE and the daemon's Python, 0.14-0.34 ms on the loaded 2-vCPU VM."""
        unit = min(CALIBRATION_UNIT, profile.max_sectors_kb << 10)
        buffer = mmap.mmap(-1, unit)  # page-aligned, as O_DIRECT needs
        fd = os.open(str(self.device), os.O_RDONLY | os.O_DIRECT)
        try:
            taken = []
            for i in range(CALIBRATION_READS):
                start = time.perf_counter()
                os.preadv(fd, [buffer], i * unit)
                taken.append(time.perf_counter() - start)
        finally:
            os.close(fd)
        return statistics.median(taken)

    def _await_fuse_mount(self) -> None:
        deadline = time.monotonic() + MOUNT_WAIT_S
        assert self.daemon is not None
        while not os.path.ismount(self.fuse_dir):
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                said = self.daemon_log.read_text(errors="replace").strip().splitlines()
                raise DeviceTwinError("the twin's FUSE daemon did not mount"
                                      + (f": {said[-1]}" if said else ""))
            time.sleep(0.05)

    def _tune(self, profile: Profile) -> None:
        """The profile's largest transfer, and a check that loop really does direct I/O (in
        buffered mode it reads one request at a time, whatever the profile says)."""
        assert self.device is not None
        block = Path("/sys/block") / Path(self.device).name
        (block / "queue" / "max_sectors_kb").write_text(f"{profile.max_sectors_kb}\n")
        if (block / "loop" / "dio").read_text().strip() != "1":
            raise DeviceTwinError(f"{self.device} refused direct I/O over the FUSE file")

    def tear_down(self) -> list[str]:
        """Undo every step that was done, each attempted even when an earlier one fails; the
        failures, one line each."""
        problems: list[str] = []
        steps = [(self.mounted, self._unmount), (self.device is not None, self._detach),
                 (self.daemon is not None, self._stop_daemon), (True, self._remove_files)]
        for needed, step in steps:
            if needed:
                try:
                    step()
                except (OSError, subprocess.SubprocessError, DeviceTwinError) as e:
                    problems.append(str(e))
        return problems

    def _unmount(self) -> None:
        if _try("umount", str(self.kv_dir)):
            _run("umount", "--lazy", str(self.kv_dir))  # a reader still holds a file open
        self.mounted = False

    def _detach(self) -> None:
        assert self.device is not None
        _run("losetup", "--detach", self.device)
        self.device = None

    def _stop_daemon(self) -> None:
        assert self.daemon is not None
        if os.path.ismount(self.fuse_dir) and _try("fusermount3", "-u", str(self.fuse_dir)):
            _run("umount", "--lazy", str(self.fuse_dir))
        try:
            self.daemon.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            self.daemon.wait(EXIT_WAIT_S)
        self.daemon = None

    def _remove_files(self) -> None:
        self.backing.unlink(missing_ok=True)
        self.daemon_log.unlink(missing_ok=True)
        for folder in (self.kv_dir, self.fuse_dir, self.folder):
            if folder.exists():
                folder.rmdir()


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=READY_TIMEOUT_S)
    if done.returncode:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise DeviceTwinError(f"{argv[0]} failed: {said}")
    return done.stdout.strip()


def _try(*argv: str) -> int:
    """Run a step whose failure has a fallback; its exit status."""
    return subprocess.run(argv, capture_output=True, timeout=READY_TIMEOUT_S).returncode


def _owner_gone(owner_pid: int) -> int:
    """A pidfd of the owner: readable once it has exited. The pipe's EOF alone would miss an
    owner whose children inherited the pipe's write end."""
    return os.pidfd_open(owner_pid)


def supervise(profile: Profile, parent: Path, size: int, owner_pid: int) -> int:
    """Build the twin, report it on stdout as one JSON line, hold it until the owner closes
    stdin or exits (or SIGTERM/SIGINT/SIGHUP arrive), then tear it down. Exit status 0, or 1
    when a step failed (the failure on stderr, one line)."""
    owner = _owner_gone(owner_pid)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    stack = _Stack(Path(tempfile.mkdtemp(prefix="kvscope-twin-", dir=parent)))
    failed = False
    try:
        own_s = stack.build(profile, size)
        print(json.dumps({"device": stack.device, "mountpoint": str(stack.kv_dir),
                          "profile": asdict(profile), "stack_latency_us": own_s * 1e6}),
              flush=True)
        select.select([sys.stdin, owner], [], [])
    except DeviceTwinError as e:
        print(e, file=sys.stderr)
        failed = True
    finally:
        problems = stack.tear_down()
    for problem in problems:
        print(f"tear-down: {problem}", file=sys.stderr)
    return 1 if failed or problems else 0


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Hold a device twin until stdin closes (what device_twin() runs).")
    parser.add_argument("profile", choices=sorted(PROFILES))
    parser.add_argument("parent", type=Path, help="folder for the twin's private folder")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE)
    parser.add_argument("--owner", type=int, default=os.getppid(),
                        help="tear down when this process exits (default: the parent)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print(NOT_ROOT, file=sys.stderr)
        return 2
    return supervise(PROFILES[args.profile], args.parent, args.size, args.owner)


if __name__ == "__main__":
    sys.exit(main())
