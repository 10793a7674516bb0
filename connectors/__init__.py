"""Data-plane plugins shipped with kvxfer, installed as ``kvxfer.connectors.<name>``.

Each one is registered in the ``kvxfer.connectors`` entry-point group (pyproject.toml)
exactly as a third-party plugin would be; nothing in the core imports them by name.
"""
