"""DeepSpeed hostfiles, checked line by line before a multi-node launch.

A hostfile lists the machines of a job, one per line, in DeepSpeed's (MPI-style) format:

    # comments start with '#'; blank lines are ignored
    worker-0 slots=8      # host name or IP, then the number of ranks (GPUs) it runs
    worker-1 slots=8

Ranks are numbered in file order: worker-0 runs ranks 0-7, worker-1 ranks 8-15; the world size is
the sum of the slots. ``deepspeed --hostfile`` itself falls back to "local resources only" with just
a warning when the file is missing, and names neither the line nor the fix for a malformed one;
``read_hostfile`` raises a ``ConfigError`` naming the file, the line number, the line and the fix.

    python -m tp_trainer.hostfile HOSTFILE [--node_rank N]

prints the hosts and their ranks, or the error (exit status 2); ``launch/multinode.sh`` runs it
before starting the launcher.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from .config import ConfigError

FORMAT = "one `HOST slots=N` line per node, N >= 1 its ranks; '#' starts a comment"
_SLOTS = re.compile(r"slots=(.*)", re.ASCII)
_DIGITS = re.compile(r"[0-9]+", re.ASCII)


def read_hostfile(path) -> list[tuple[str, int]]:
    """The hosts of a DeepSpeed hostfile as ``[(host, slots), ...]`` in file (= rank) order."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"hostfile {path!r}: file not found; pass the path of a DeepSpeed hostfile "
                          f"({FORMAT}; see launch/hostfile.example)")
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except UnicodeDecodeError as err:
        raise ConfigError(f"hostfile {path!r}: not UTF-8 text ({err.reason} at byte {err.start}); "
                          f"write it as plain text, {FORMAT}") from None
    hosts: list[tuple[str, int]] = []
    first_seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        where = f"hostfile {path!r}, line {number}: {raw.strip()!r}"
        tokens = entry.split()
        host = tokens[0]
        if host.startswith("slots="):
            raise ConfigError(f"{where}: no host name before {host!r}; write `HOST {host}` "
                              f"(the host name or IP comes first)")
        if len(tokens) == 1:
            raise ConfigError(f"{where}: missing slots=N after the host; write `{host} slots=N` "
                              f"with N the number of ranks (GPUs) on {host}")
        match = _SLOTS.fullmatch(tokens[1])
        if match is None:
            fix = (f"`{host} slots={tokens[1]}`" if _DIGITS.fullmatch(tokens[1]) else f"`{host} slots=N`")
            raise ConfigError(f"{where}: expected slots=N after the host, got {tokens[1]!r}; write {fix}")
        value = match.group(1)
        if not _DIGITS.fullmatch(value):
            raise ConfigError(f"{where}: slots={value!r} is not a positive integer; write `{host} slots=N` "
                              f"with N a whole number >= 1 (the ranks on {host})")
        slots = int(value)
        if slots == 0:
            raise ConfigError(f"{where}: slots=0 gives {host} no ranks; set slots >= 1 or delete the line "
                              f"(or comment it out with '#')")
        if len(tokens) > 2:
            extra = " ".join(tokens[2:])
            raise ConfigError(f"{where}: unexpected {extra!r} after slots={value}; a line is only "
                              f"`{host} slots={slots}` (put remarks after '#')")
        if host in first_seen:
            raise ConfigError(f"{where}: host {host!r} is already listed on line {first_seen[host]}; "
                              f"list each host once, with all its slots on one line")
        first_seen[host] = number
        hosts.append((host, slots))
    if not hosts:
        raise ConfigError(f"hostfile {path!r}: no hosts (the file is empty or only comments); add "
                          f"{FORMAT}, e.g. `worker-0 slots=8`")
    return hosts


def describe(hosts: list[tuple[str, int]]) -> list[str]:
    """One line per node: its node rank, host, slots and global ranks (file order)."""
    lines, first = [], 0
    for node, (host, slots) in enumerate(hosts):
        ranks = f"rank {first}" if slots == 1 else f"ranks {first}-{first + slots - 1}"
        lines.append(f"node {node}: {host} slots={slots} ({ranks})")
        first += slots
    return lines


def check_node_rank(hosts: list[tuple[str, int]], node_rank: int, path: str) -> None:
    """``--no_ssh`` launches need 0 <= node_rank < number of hosts (DeepSpeed only asserts it)."""
    if not 0 <= node_rank < len(hosts):
        raise ConfigError(f"--node_rank {node_rank}: hostfile {path!r} has {len(hosts)} host(s), so the node "
                          f"rank must be 0..{len(hosts) - 1}; node k is the k-th host line of the file")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tp_trainer.hostfile",
                                     description="Check a DeepSpeed hostfile and print its hosts and ranks.")
    parser.add_argument("hostfile")
    parser.add_argument("--node_rank", type=int, help="also check this node rank against the hosts")
    args = parser.parse_args(argv)
    try:
        hosts = read_hostfile(args.hostfile)
        if args.node_rank is not None:
            check_node_rank(hosts, args.node_rank, args.hostfile)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    world = sum(slots for _, slots in hosts)
    print(f"hostfile {args.hostfile}: {len(hosts)} host(s), world size {world}")
    for line in describe(hosts):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
