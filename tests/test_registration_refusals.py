"""The head remembers the nodes it refused (one error line each, not one per beat), but only the last so many: node
ids come from the network, and whoever reaches the registration port could send new ones without end."""
from __future__ import annotations

from ipc.config import ServeConfig
from ipc.registration import NodeHello, encode_node_message
from supervisor.layout import Layout
from supervisor.registration import REFUSED_KEPT, Registry


def test_refused_node_ids_are_remembered_within_a_bound():
    config = ServeConfig(data_parallel_size=2, data_parallel_address="127.0.0.1", data_parallel_rpc_port=0)
    registry = Registry(config, Layout(size=2, local_ranks=(0,), remote_ranks=(1,)), curve=None)
    try:
        for i in range(REFUSED_KEPT + 2000):  # each a new node that names the wrong size: refused
            hello = NodeHello(node_id=f"node-{i}", node_name="x", data_parallel_size=3, ranks=[1],
                              addresses=["tcp://127.0.0.1:1"], model_name=config.model_name, vocab_size=1,
                              max_model_len=1, head_id="")
            registry._on_message(b"peer", encode_node_message(hello))
        assert len(registry._refused) <= REFUSED_KEPT
        assert registry.registered() == {}
    finally:
        registry.close()
