"""The head remembers the nodes it refused (one error line each, not one per beat), but only the last so many: node
ids come from the network, and whoever reaches the registration port could send new ones without end. And it takes
a node's queued messages as the node meant them."""
from __future__ import annotations

import time

import zmq

from ipc.config import ServeConfig
from ipc.registration import NodeDraining, NodeHello, NodeLeaving, encode_node_message
from supervisor.events import RankJoined, RankLost
from supervisor.layout import Layout
from supervisor.registration import REMEMBERED, Registry


def test_refused_node_ids_are_remembered_within_a_bound():
    config = ServeConfig(data_parallel_size=2, data_parallel_address="127.0.0.1", data_parallel_rpc_port=0)
    registry = Registry(config, Layout(size=2, local_ranks=(0,), remote_ranks=(1,)), curve=None)
    try:
        for i in range(REMEMBERED + 2000):  # each a new node that names the wrong size: refused
            hello = NodeHello(node_id=f"node-{i}", node_name="x", data_parallel_size=3, ranks=[1],
                              addresses=["tcp://127.0.0.1:1"], model_name=config.model_name, vocab_size=1,
                              max_model_len=1, head_id="")
            registry._on_message(b"peer", hello)
        assert len(registry._refused) <= REMEMBERED
        assert registry.registered() == {}
    finally:
        registry.close()


def test_a_node_s_stale_hellos_behind_its_leaving_do_not_register_it_again():
    """The head's supervisor was stopped (SIGSTOP) while a node drained and left: on SIGCONT its HELLOs still wait
    before its LEAVING. Taken in turn they registered the gone node again (a rolling restart whose new servers died
    reaching its engine). Each peer's last message counts; a node that left is not taken back by a late HELLO."""
    config = ServeConfig(data_parallel_size=2, data_parallel_address="127.0.0.1", data_parallel_rpc_port=0)
    registry = Registry(config, Layout(size=2, local_ranks=(0,), remote_ranks=(1,)), curve=None)
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    node = ctx.socket(zmq.DEALER)
    node.setsockopt(zmq.IDENTITY, b"node-a")
    try:
        node.connect(registry._sock.getsockopt(zmq.LAST_ENDPOINT).decode())
        hello = NodeHello(node_id="node-a", node_name="a", data_parallel_size=2, ranks=[1],
                          addresses=["tcp://127.0.0.1:9"], model_name=config.model_name, vocab_size=1, max_model_len=1,
                          head_id="")

        def sent_then_taken(*records) -> list:
            for record in records:
                node.send_multipart(encode_node_message(record))
            time.sleep(0.3)  # all of them queued on the port, as behind a stopped head
            return registry.take()

        assert [type(e) for e in sent_then_taken(hello)] == [RankJoined]
        events = sent_then_taken(hello, hello, NodeDraining("node-a", "stopped"), NodeLeaving("node-a", "stopped"))
        assert [(type(e), e.rank) for e in events] == [(RankLost, 1)] and "its node left" in events[0].reason
        assert sent_then_taken(hello) == [] and registry.registered() == {}
    finally:
        node.close()
        ctx.term()
        registry.close()
