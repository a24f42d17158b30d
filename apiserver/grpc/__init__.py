"""The gRPC API server (`supervise --grpc`): the same role as the HTTP API server, other wire.

It serves the `vllm.grpc.engine.VllmEngine` service of the published `smg-grpc-proto` package, so a gateway
that speaks it (smg) drives the group with token ids: the gateway tokenizes, renders chat templates, matches
stop strings and parses tools itself. This server loads no tokenizer and no torch; it validates, admits, and
relays between gRPC calls and the engine client, with the HTTP server's heartbeat, metrics files and drain.
"""
