"""Ops: how a trace op becomes a callable (resolve, translate, stand-ins, recorded outputs)."""
