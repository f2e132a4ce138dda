"""The storage protocol: the typed wire contract (`protocol`), one Lua script per atomic
operation (`lua/`) and their runner (`scripts`), which node a call goes to (`routing`),
the key layout (`keys`), JSON in and out (`codec`) and the table of queue settings
(`settings`). Built on the transport; the client and the worker speak it."""
