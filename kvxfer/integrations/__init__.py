"""Adapters that put kvxfer under other serving engines.

Importing this package imports no engine; each adapter module imports its engine itself.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

VLLM_CONNECTOR_NAME = "KvxferConnector"


def register_vllm() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts, so
    ``kv_connector: KvxferConnector`` resolves without ``kv_connector_module_path``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(VLLM_CONNECTOR_NAME, "kvxfer.integrations.vllm", "KvxferConnector")
    except ValueError:  # registered already (the plugin runs once per process, but be safe)
        logger.debug("%s is already registered with vLLM", VLLM_CONNECTOR_NAME)
