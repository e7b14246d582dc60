"""Shared building blocks: errors, config, deadlines, wire framing, RPC, logging, metrics.

Must never import a component package (transfer, store, conductor, ...).
"""
