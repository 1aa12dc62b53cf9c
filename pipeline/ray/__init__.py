"""Ray launch layer: `gkd ray score|generate` (the entry is pipeline/ray/cli.py); the on-policy executor on Ray
is pipeline/onpolicy/ray.py.

    cluster.py  connecting (auto | HOST:PORT | ray://HOST:PORT | local), token auth, and the checks that make
                Ray's waits clear errors in seconds (unreachable address, resources no node has, Ray missing)
    cli.py      one Ray task per shard index of a stage, with the stage's own markers, --status and resume

Ray itself is an optional install (`pip install -e '.[ray]'`); nothing here imports it at module level.
"""
