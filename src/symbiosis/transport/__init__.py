"""How clients reach an executor: in-process, same host (`ipc://`), another host (`tcp://`).

`symbiosis.connect(url)` picks the transport from the URL scheme; every transport offers the same
`attach(fingerprint, name, device)` -> session with `forward`, `forward_nobias`, `backward`, `fetch`,
`weight_norms`, `close`.
"""
