"""Bytes that cross node boundaries per training step, on paper, from the byte ledger's own rules.

Question: How many bytes cross node boundaries per step, with and without secondary shards and int8 gathers?

    python examples/benchmarks/bytes_across_nodes.py                                   # 70B model, 8 nodes x 8 GPUs, bf16
    python examples/benchmarks/bytes_across_nodes.py --params 20.3e6 --nodes 2 --ranks-per-node 2 --bytes 4
                                                                            # benchmark.py --nodes 2's GPT, fp32

For each strategy, the bytes one rank receives from ranks on other nodes in one step, by the rule of
[Note: inter-node bytes] in ``lightning_zero3/engine/comm/topology.py`` (``inter_node_bytes``, the function the
ledger itself calls), and the sum over the ranks of one node. P parameters of ``--bytes`` bytes each
(gathered parameters and reduced gradients alike), N = nodes x ranks per node ranks:

- DDP: one all-reduce of the gradients (S = P x bytes) over all ranks;
- FSDP / zero3: an all-gather of the parameters for forward and another for backward, and a
  reduce-scatter of the gradients, all over all ranks;
- zero3 + hpZ (``secondary_shard_size="node"``): backward's all-gather runs inside the node (0 bytes);
- zero3 + hpZ + int8 (``quantize_gathers="int8"``): forward's all-gather sends int8 blocks of 256 with an
  fp32 scale each (``payload_bytes`` of ``lightning_zero3/engine/comm/quantize.py``).

It counts every parameter in every collective: a real run differs by the parameters kept whole (the
persistent group: gathered once per step, after the optimizer step), the unit kept gathered from forward
into backward (``max_reuse_distance``), padding, and the 80-byte identity checks. ``benchmark.py --nodes 2``
prints the measured figures to compare with.
"""

from __future__ import annotations

import argparse

from lightning_zero3.engine.comm.quantize import payload_bytes
from lightning_zero3.engine.comm.topology import inter_node_bytes


def per_rank(params: int, nodes: int, ranks_per_node: int, nbytes: int) -> dict[str, int]:
    """Bytes one rank receives from other nodes in one step, per strategy."""
    n = nodes * ranks_per_node
    remote = n - ranks_per_node  # ranks of the job on other nodes than this rank's
    full = params * nbytes
    int8_full = payload_bytes(-(-params // n)) * n  # every rank's int8 payload of its shard
    gather, reduce = inter_node_bytes("all_gather", full, n, remote), inter_node_bytes("reduce_scatter", full, n, remote)
    return {
        "DDP": inter_node_bytes("all_reduce", full, n, remote),
        "FSDP / zero3": 2 * gather + reduce,
        "zero3 + hpZ": gather + reduce,
        "zero3 + int8": 2 * inter_node_bytes("all_gather", int8_full, n, remote) + reduce,
        "zero3 + hpZ + int8": inter_node_bytes("all_gather", int8_full, n, remote) + reduce,
    }


def table(params: int, nodes: int, ranks_per_node: int, nbytes: int) -> str:
    rows = per_rank(params, nodes, ranks_per_node, nbytes)
    base = rows["FSDP / zero3"]
    unit, scale = ("GB", 1e9) if params * nbytes >= 1e9 else ("MB", 1e6)
    lines = [
        (f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M")
        + f" parameters x {nbytes} bytes, {nodes} nodes x {ranks_per_node} ranks",
        f"| strategy | per rank ({unit}/step) | per node ({unit}/step) | vs zero3 |",
        "|---|---:|---:|---:|",
    ]
    for name, value in rows.items():
        lines.append(
            f"| {name} | {value / scale:.2f} | {value * ranks_per_node / scale:.2f} | {value / base:.3f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=70e9)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--bytes", type=int, default=2, help="bytes per parameter and gradient element (2: bf16)")
    args = parser.parse_args()
    print(table(int(args.params), args.nodes, args.ranks_per_node, args.bytes))


if __name__ == "__main__":
    main()
