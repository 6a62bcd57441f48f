"""The adapters: Bridge's callback, Lightning's, and the loop API, each turning its framework's events into
calls on one shared :class:`~.session.Session`, plus the recipe helpers that add Bridge's callback from YAML.
"""
