"""The contract between the supervisor, the engine cores and the API servers.

Nothing here imports torch, transformers, starlette or uvicorn: every process imports ipc.
"""
