"""A slow network on one machine: a command run in a private network namespace, its loopback capped.

`fastt run --launcher torchrun --network 1gbit` starts torchrun (and so every rank) through `capped`: `unshare
-n` gives the command a network namespace of its own, whose loopback is brought up and capped with a token
bucket (`tc qdisc ... tbf`), then the command is exec'd in it. Every rank's gloo traffic and torchrun's store
then go through that one capped loopback: one link shared by all the ranks, as between two servers. The
namespace holds no name and no mount, so the kernel removes it when its last process exits; the machine's own
interfaces are never touched (every `ip` and `tc` runs inside the new namespace).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import FasttError

# tc's rate units (tc(8)): bits or bytes per second, SI or IEC prefixes; a bare number is bits per second.
_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*(|k|m|g|t|ki|mi|gi|ti)(bit|bps)?", re.IGNORECASE)
_MIN_BURST = 128 * 1024  # above the loopback's 64 KiB MTU: tbf drops a packet larger than its bucket
# tbf's queue limit as a delay: a packet that would wait longer is dropped, and TCP backs off.
_LATENCY = "20ms"
_SETUP = ('ip link set lo up && tc qdisc add dev lo root tbf rate "$1" burst "$2" latency "$3" '
          '&& shift 3 && exec "$@"')


@dataclass(frozen=True)
class Network:
    """A loopback cap: the rate as the user wrote it (tc's form) and in bits per second."""

    rate: str
    bits_per_s: float

    @property
    def burst_bytes(self) -> int:
        """The token bucket: at least a millisecond of traffic, so that the cap, not the bucket, sets the
        rate."""
        return max(_MIN_BURST, int(self.bits_per_s / 8 / 1000))


def network(text: str) -> Network:
    """`--network RATE` (1gbit, 100mbit, 10Gbit, 125mbps, ...): a FasttError saying the forms otherwise."""
    m = _RATE.fullmatch(text.strip())
    bits = 0.0
    if m:
        bits = float(m[1]) * _PREFIX[m[2].lower()] * (8 if (m[3] or "bit").lower() == "bps" else 1)
    if bits <= 0:
        raise FasttError(f"--network {text!r}: expected a rate as tc writes one, e.g. 1gbit, 100mbit, 10gbit "
                         "or 125mbps")
    return Network(text.strip().lower(), bits)


def unavailable() -> str | None:
    """Why this process cannot make a capped namespace (no root, no unshare, ip or tc), None when it can."""
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (util-linux's unshare and iproute2's ip and tc are needed)"
    if os.geteuid() != 0:
        return "making a network namespace needs root (unshare -n), and this process is not root"
    return None


def capped(net: Network, cmd: Sequence[str]) -> list[str]:
    """`cmd` run in a fresh network namespace whose loopback is capped at `net`'s rate."""
    return ["unshare", "--net", "--", "sh", "-c", _SETUP, "sh", net.rate, str(net.burst_bytes), _LATENCY,
            *cmd]


def check(net: Network, timeout_s: float = 20.0) -> None:
    """Make one capped namespace and let it go: a FasttError in one line, saying why, where that fails
    (no root, a tool missing, a rate tc refuses), before any rank starts."""
    why = unavailable()
    if why is None:
        try:
            r = subprocess.run(capped(net, ["true"]), capture_output=True, text=True,
                               timeout=timeout_s, check=False)
            said = " ".join(r.stderr.split())[-300:]
            why = None if r.returncode == 0 else f"{said or f'exit code {r.returncode}'}"
        except subprocess.TimeoutExpired:
            why = f"making it took over {timeout_s:.0f} s"
    if why is not None:
        raise FasttError(f"--network {net.rate}: cannot run the ranks in a private network namespace with a "
                         f"capped loopback: {why}; run without --network, or as root where unshare and tc "
                         "are")
