"""Expert parallelism on paper: the all-to-all volume a GPU sends per training step when the
experts of each MoE layer are spread over G GPUs (E / G each), for the layer shapes of the MoE
benchmark. Computed, not measured (benchmarks/results/moe/README.md explains the table).

    python benchmarks/moe_ep_plan.py               # the markdown table of the README

Per layer and step, a GPU's T tokens go out to the GPUs of their k experts (dispatch) and come
back weighted (combine), and the backward sends the gradients of both the same way: 4 transfers
of ``H`` bf16 values per routed copy. Three ways of counting a token's copies (routing uniform
over the experts, k distinct experts a token):
  - per expert: k copies, those to this GPU's own experts stay (k (G - 1) / G a token);
  - per GPU: one copy per distinct destination GPU (E[distinct GPUs among k experts] (G - 1) / G);
  - per node, then NVLink (DeepSeek's node-limited dispatch): one copy per distinct remote node
    over the inter-node network, the rest inside the node over NVLink.
"""
from __future__ import annotations

from math import comb

BYTES = 2  # bf16
# name -> (experts, top-k, hidden, MoE layers)
MODELS = {"Qwen3-30B-A3B": (128, 8, 2048, 48), "Mixtral-8x7B": (8, 2, 4096, 32),
          "DeepSeek-V3": (256, 8, 7168, 58)}
GPUS_PER_NODE = 8


def distinct(groups: int, per_group: int, k: int) -> float:
    """Expected number of groups hit by k distinct experts drawn uniformly from ``groups`` groups
    of ``per_group``."""
    total = groups * per_group
    return groups * (1 - comb(total - per_group, k) / comb(total, k))


def volumes(experts: int, k: int, hidden: int, layers: int, gpus: int, tokens: int) -> dict:
    """GB a GPU sends per step: per expert copy, per destination GPU, and per destination node
    (inter-node part) for ``tokens`` tokens a GPU; None where E < G (experts then replicated)."""
    if experts < gpus:
        return {}
    per_gpu = experts // gpus
    copies = {"expert": k * (gpus - 1) / gpus, "gpu": distinct(gpus, per_gpu, k) * (gpus - 1) / gpus}
    nodes = gpus // GPUS_PER_NODE
    if nodes > 1:
        copies["node"] = distinct(nodes, per_gpu * GPUS_PER_NODE, k) * (nodes - 1) / nodes
    scale = 4 * tokens * hidden * BYTES * layers / 1e9
    return {way: n * scale for way, n in copies.items()}


def table(tokens: int = 8192) -> str:
    lines = [f"| model, G GPUs | per expert copy | per GPU (dedup) | inter-node, per node (dedup) |",
             "|---|---|---|---|"]
    for name, (experts, k, hidden, layers) in MODELS.items():
        for gpus in (8, 64):
            v = volumes(experts, k, hidden, layers, gpus, tokens)
            if not v:
                lines.append(f"| {name}, {gpus} | E = {experts} < G: experts replicated (EP {experts} x DP "
                             f"{gpus // experts}) | | |")
                continue
            node = f"{v['node']:.1f}" if "node" in v else "- (one node: all NVLink)"
            lines.append(f"| {name}, {gpus} | {v['expert']:.1f} | {v['gpu']:.1f} | {node} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(f"GB sent per GPU per training step (forward + backward), 8192 tokens a GPU, bf16:\n\n{table()}")
