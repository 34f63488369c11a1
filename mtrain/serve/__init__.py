"""An OpenAI-compatible front on the in-process engines that records the exact tokens of every call
(`front.py`: the work; `sessions.py`: recording; `app.py`: the HTTP routes; `server.py`: uvicorn in a thread)."""
