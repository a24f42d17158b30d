"""The API server: uvicorn + Starlette + an EngineClient per process; no torch."""
