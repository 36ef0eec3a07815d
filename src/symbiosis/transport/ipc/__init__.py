"""The same-host transport, `ipc://`: layer calls through shared memory the executor makes (`shm`, handed
over by `handoff`), a control block and pipe bytes (`doorbell`); for a client on the executor's GPU,
pipelined calls ordered by CUDA stream memory operations (`streamops`, `streamledger`, `streams`,
`pipelined`)."""
