"""The handler a soak worker process runs (`effectmq worker bench._soak_handlers:app`)."""

import effectmq

app = effectmq.App()


@app.task
async def noop(_payload):
    return None
