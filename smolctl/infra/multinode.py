"""benchmark-nccl across nodes: which node pairs to probe, in which order, and the report that names the slowest
host, rail and link. Pure arithmetic on timings; collective_runner.py does the transfers.

    shifts = ring_shifts(16)                       # [1, 2, 4, 8]: every node meets 8 others
    phases = link_schedule(16, shift=4)            # one-way transfers, no node busy twice in a phase
    report = summarize(rank_hosts, intra, inter, links, size)

Why one-way transfers: a rank that sends and receives at once cannot tell which direction was slow, so each
directed link (node a → node a + shift, same local rank: rail-aligned) runs while its ends do nothing else, and
the sender's and the receiver's clocks are both kept.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from smolctl.infra.collectives import bandwidths

SHIFTS = (1, 2, 4, 8)  # ring distances: neighbours, then farther nodes (other leaf switches, other pods)
SLOWEST_HOSTS = 5


def ring_shifts(nodes: int) -> list[int]:
    return [shift for shift in SHIFTS if shift < nodes]


def link_schedule(nodes: int, shift: int) -> list[list[tuple[int, int]]]:
    """The directed node pairs (a, a + shift mod nodes) split into phases in which every node is in at most one
    pair: the pairs form cycles, coloured alternately (a third colour closes an odd cycle)."""
    phases: list[list[tuple[int, int]]] = [[], [], []]
    seen: set[int] = set()
    for start in range(nodes):
        cycle, node = [], start
        while node not in seen:
            seen.add(node)
            cycle.append(node)
            node = (node + shift) % nodes
        for i, node in enumerate(cycle):
            colour = 2 if len(cycle) % 2 and i == len(cycle) - 1 else i % 2
            phases[colour].append((node, (node + shift) % nodes))
    return [phase for phase in phases if phase]


@dataclass(frozen=True)
class Link:
    shift: int
    sender: int
    receiver: int
    send_seconds: float
    recv_seconds: float

    @property
    def seconds(self) -> float:
        """A transfer is done when both ends are."""
        return max(self.send_seconds, self.recv_seconds)


def _groups(groups: list[list[int]], seconds: list[float], size: int, name) -> dict:
    rows = [(bandwidths("all_reduce", size, t, len(g))[1], g) for g, t in zip(groups, seconds) if len(g) > 1]
    slowest = min(rows, key=lambda row: row[0], default=None)
    return {
        "groups": len(rows),
        "ranks_per_group": max((len(g) for g in groups), default=0),
        "busbw_min": slowest[0] if slowest else None,
        "busbw_median": statistics.median(row[0] for row in rows) if rows else None,
        "slowest": {"name": name(slowest[1]), "ranks": slowest[1], "busbw": slowest[0]} if slowest else None,
    }


def summarize(
    rank_hosts: list[str],
    intra: tuple[list[list[int]], list[float]],
    inter: tuple[list[list[int]], list[float]],
    links: list[Link],
    size: int,
) -> dict:
    """The multi-node section: all_reduce inside each node (slowest: its host) and across nodes per rail
    (slowest: its local rank), and the one-way links (slowest link, and hosts by their links' median)."""

    def busbw(seconds: float) -> float:
        return size / seconds / 1e9

    report = {
        "size": size,
        "intra_node": _groups(*intra, size, lambda ranks: rank_hosts[ranks[0]]),
        "inter_node": _groups(*inter, size, lambda ranks: f"rail {inter[0].index(ranks)}"),
    }
    timed = [link for link in links if link.seconds == link.seconds]  # NaN: a pair a smaller node could not make
    if not timed:
        report["links"] = None
        return report
    slowest = max(timed, key=lambda link: link.seconds)
    by_host: dict[str, list[float]] = {}
    for link in timed:
        for host in {rank_hosts[link.sender], rank_hosts[link.receiver]}:
            by_host.setdefault(host, []).append(busbw(link.seconds))
    hosts = sorted(((statistics.median(values), host, len(values)) for host, values in by_host.items()))
    report["links"] = {
        "shifts": sorted({link.shift for link in timed}),
        "count": len(timed),
        "send_busbw_median": statistics.median(busbw(link.send_seconds) for link in timed),
        "recv_busbw_median": statistics.median(busbw(link.recv_seconds) for link in timed),
        "slowest": {
            "from_rank": slowest.sender,
            "from_host": rank_hosts[slowest.sender],
            "to_rank": slowest.receiver,
            "to_host": rank_hosts[slowest.receiver],
            "shift": slowest.shift,
            "send_busbw": busbw(slowest.send_seconds),
            "recv_busbw": busbw(slowest.recv_seconds),
            "busbw": busbw(slowest.seconds),
        },
        "slowest_hosts": [
            {"host": host, "links": count, "busbw_median": median} for median, host, count in hosts[:SLOWEST_HOSTS]
        ],
    }
    return report
