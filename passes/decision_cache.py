"""On-disk cache of the fuse pass's result: the same ATen graph is not searched twice.

The fuse pass is most of the backend's compile time (every accepted merge is lowered to check
that it makes one kernel). Its result depends only on the graph, its shapes and size hints, the
configuration, the device profile and the compiler's own code, so a second process compiling
the same model restores the groups (and the recorded decisions) from disk instead.

    <cache_dir>/graphs/<key[:2]>/<key>.pkl    {"key", "groups", "recomputed", "decisions"}

``key`` hashes all of the above (the source of passes/ and codegen/ included: any change to the
compiler is a new namespace). Entries are written atomically; one that does not load, names a
node the graph lacks, or has another key is ignored (and rewritten), never trusted.
"""
from __future__ import annotations

import hashlib
import logging
import pickle
from pathlib import Path

import torch

from ..codegen.cache import atomic_write, source_fingerprint

log = logging.getLogger("fusion_compiler")


# the fuse pass's result depends on passes/ and on the code generator (legality is lowering)
_FINGERPRINT = source_fingerprint(Path(__file__).parent, Path(__file__).parent.parent / "codegen")


def graph_key(gm: torch.fx.GraphModule, ctx) -> str:
    """Hash of everything the fuse pass's result depends on."""
    h = hashlib.sha256(_FINGERPRINT.encode())
    cfg = ctx.config
    h.update(repr((cfg.max_group_ops, cfg.max_persistent_block, cfg.max_resident_row,
                   cfg.tiles, ctx.profile)).encode())      # tiles: legality (read_beside)
    h.update(repr(sorted((str(k), int(v)) for k, v in ctx.size_hints.items())).encode())
    for n in gm.graph.nodes:
        info = n.meta.get("fc_tensor")
        h.update(repr((n.name, n.op, str(n.target), str(n.args), str(n.kwargs),
                       str(n.meta.get("fc_kind")), info.key if info is not None else None,
                       str(n.meta.get("fc_symint")))).encode())
    return h.hexdigest()[:32]


def _path(ctx, key: str) -> Path:
    return Path(ctx.config.cache_dir) / "graphs" / key[:2] / f"{key}.pkl"


def load(gm: torch.fx.GraphModule, ctx, key: str):
    """The stored result for ``key`` with node names resolved, or None."""
    path = _path(ctx, key)
    if not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
        if entry.get("key") != key:
            raise ValueError("key mismatch")
        by_name = {n.name: n for n in gm.graph.nodes}
        groups = [dict(g, members=[by_name[m] for m in g["members"]],
                       recomputed=[by_name[m] for m in g["recomputed"]],
                       extra_outputs=[by_name[m] for m in g["extra_outputs"]])
                  for g in entry["groups"]]
        unfused = {by_name[m]: cost for m, cost in entry["unfused"].items()}
        return (groups, [by_name[m] for m in entry["recomputed_anywhere"]], entry["decisions"],
                unfused)
    except Exception as exc:                      # noqa: BLE001 - a bad entry is recomputed
        log.warning("fusion-compiler: fusion decision cache entry %s is damaged (%s: %s); "
                    "deciding again", path, type(exc).__name__, exc)
        return None


def store(ctx, key: str, groups, recomputed_anywhere, decisions) -> None:
    entry = {"key": key,
             "groups": [{"id": g.id, "members": [n.name for n in g.members],
                         "recomputed": [n.name for n in g.recomputed],
                         "extra_outputs": [n.name for n in g.extra_outputs],
                         "error": g.error} for g in groups],
             "recomputed_anywhere": [n.name for n in recomputed_anywhere],
             "decisions": decisions,
             # each data node's cost run alone (ctx.unfused_cost): a function of the graph and
             # the profile, both in the key; recomputing them took a third of a warm analyze
             "unfused": {n.name: cost for n, cost in ctx.unfused_cost.items()}}
    path = _path(ctx, key)
    try:
        data = pickle.dumps(entry)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)
    except Exception as exc:                      # noqa: BLE001 - the cache is an optimisation
        log.debug("fusion-compiler: fusion decisions not cached (%s: %s)", type(exc).__name__, exc)
