"""Graph passes (installed as ``autopar.passes``): normalize, analyze, shard, split, codegen.

Every pass has the signature ``(gm, ctx) -> PassResult`` (see :mod:`autopar.passes.infra`).
Passes import only the shared vocabulary (:mod:`autopar.ir`, :mod:`autopar.errors`), never the
API, planner or CLI.
"""
