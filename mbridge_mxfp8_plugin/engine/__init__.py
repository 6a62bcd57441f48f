"""The engine: when and what to sync (``sync``), the copy plans it runs (``plan``), re-deriving the
params after a checkpoint load (``resume``), and the on-demand repair (``ensure``).
"""
