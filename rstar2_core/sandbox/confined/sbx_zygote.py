"""The zygote: the process every call's child is cloned from, so that no child inherits the memory of
the template, which holds the requests' code and stdin and the calls' output. The template forks it
once at start-up, before it reads any request; per call it receives (SOCK_SEQPACKET) the call's slot,
uid, cwd and limits with the call's pipe fds, clones the child with CLONE_PARENT inside the call's own
mount namespace (made ahead), and answers its pid and that namespace's fd. It also keeps the slots'
network namespaces.

Invariant: it never receives a call's code or stdin. Standard library only; loaded by template.py;
it dies with the template (PR_SET_PDEATHSIG) and stops when the template's end of the socket closes.
See docs/sandbox.md, "How it works" (A zygote clones the children).
"""

from __future__ import annotations

import array
import os
import pickle
import signal
import socket

import sbx_child as child
import sbx_isolation as iso

N_FDS = 4   # stdin, stdout, stderr, code
DIED = "the sandbox zygote died"   # the template's RuntimeError: it cannot go on without its zygote


class Zygote:
    """The template's handle: `send` a call's spec, take the answers with `reply` when the socket is
    readable. The zygote serves the requests in order, so the answers come in the order of the sends;
    the template does not wait for them (it sends the next call's spec, reads output and reaps exits
    while the zygote clones). A clone cost the zygote ~1.0 ms median in a one-off timing on a loaded
    2-core VM (docs/sandbox.md)."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid

    def send(self, spec: dict, fds: list[int]) -> None:
        """Ask for the child of a call: `spec` {slot, uid, cwd, memory_mb, cpu_s, nproc, fsize_mb}, `fds`
        [stdin read end, stdout write end, stderr write end, code read end] (the message holds its own
        copies: the caller may close them once this returns). RuntimeError: the zygote is gone."""
        try:
            socket.send_fds(self.sock, [pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)], fds)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise RuntimeError(f"{DIED}: {e}") from e

    def reply(self) -> dict | None:
        """The next answer without blocking: {"slot", "pid", "nsfd"} (the call's mount namespace fd or -1),
        {"slot", "errno", "error"} when the zygote could not clone (that call fails), or None when no
        answer is waiting. RuntimeError: the zygote is gone (the template cannot go on)."""
        fds = array.array("i")
        try:   # not socket.recv_fds: it drops its flags argument (CPython 3.11), so it would block here
            msg, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_LEN(fds.itemsize), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except ConnectionResetError as e:
            raise RuntimeError(f"{DIED}: {e}") from e
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if not msg:
            for fd in fds:
                os.close(fd)
            raise RuntimeError(DIED)
        reply = pickle.loads(msg)
        reply["nsfd"] = fds[0] if fds else -1
        for fd in fds[1:]:
            os.close(fd)
        return reply


def start(feats: dict, cs: iso.CallSetup, procfd: int, as_base: int) -> Zygote:
    """Fork the zygote from the template (before any request). In the zygote every fd is closed but
    0-2, its socket, the host's /proc (`procfd`) and the namespaces of `cs`, which are the zygote's
    from then on: the template's copies are closed."""
    keep = cs.ns_fds()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    template = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            iso.libc.prctl(iso.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != template:
                os._exit(0)
            ours.detach()   # its fd is closed below with the template's others; no object may close it later
            if cs.reaper is not None:
                cs.reaper.detach()
            prev = 0
            for fd in sorted({0, 1, 2, theirs.fileno(), procfd, *keep}):   # not the template's pipes, reaper, selector
                if prev < fd:   # os.closerange(n, n) closes every fd from n (close_range(n, ~0))
                    os.closerange(prev, fd)
                prev = fd + 1
            os.closerange(prev, 1 << 20)
            _serve(theirs, feats, cs, procfd, as_base)
        except BaseException:  # noqa: BLE001 - the template reports "the sandbox zygote died"; this says why
            import traceback

            traceback.print_exc()
            os._exit(1)
        finally:
            os._exit(0)
    theirs.close()
    for fd in keep:
        os.close(fd)
    cs.home_mnt = cs.home_net = -1
    cs.slot_net.clear()
    return Zygote(ours, pid)


def _serve(sock: socket.socket, feats: dict, cs: iso.CallSetup, procfd: int, as_base: int) -> None:
    conf, flags = cs.conf, iso.call_clone_flags(feats)
    spare = -1
    while True:
        if spare < 0 and conf["tmp_opts"]:   # the next call's mount namespace, made while idle
            spare = iso.make_mount_ns(procfd, cs.home_mnt)
        msg, fds, _, _ = socket.recv_fds(sock, 4096, N_FDS)
        if not msg:
            return   # the template is gone
        spec = pickle.loads(msg)
        nsfd = -1
        try:
            if len(fds) != N_FDS:
                raise OSError(0, f"expected {N_FDS} fds, got {len(fds)}")
            netfd = _netns_for(feats, cs, procfd, spec["slot"])
            if conf["tmp_opts"]:   # the child is cloned into the call's own mount namespace
                if spare >= 0:
                    nsfd, spare = spare, -1
                    iso.setns(nsfd, iso.CLONE_NEWNS)
                else:
                    nsfd = iso.enter_call_mount_ns(procfd)
            pid = iso.clone_child(flags)
        except OSError as e:
            if nsfd >= 0:
                iso.setns(cs.home_mnt, iso.CLONE_NEWNS)
                os.close(nsfd)
            for fd in fds:
                os.close(fd)
            sock.send(pickle.dumps({"slot": spec["slot"], "errno": e.errno or 0, "error": e.strerror or str(e)}))
            continue
        if pid == 0:
            child.run_child(spec, tuple(fds), as_base, conf, netfd)
        if nsfd >= 0:
            iso.setns(cs.home_mnt, iso.CLONE_NEWNS)
        for fd in fds:
            os.close(fd)
        socket.send_fds(sock, [pickle.dumps({"slot": spec["slot"], "pid": pid})], [nsfd] if nsfd >= 0 else [])
        if nsfd >= 0:
            os.close(nsfd)   # the template's copy keeps the namespace until it hands it to the reaper


def _netns_for(feats: dict, cs: iso.CallSetup, procfd: int, slot: int) -> int:
    """The network namespace of call slot `slot` (made on first use): concurrent calls never share one,
    so not their abstract Unix sockets either; a call's sockets die with the call."""
    if not feats["netns_per_slot"]:
        return -1
    fd = cs.slot_net.get(slot)
    if fd is None:
        fd = cs.slot_net[slot] = iso.new_netns(procfd, cs.home_net)
    return fd
