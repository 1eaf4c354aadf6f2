"""The prefill role: compute a prompt's KV and write the window [begin, end) into a decode
node's reserved slots over NIXL (`role.PrefillRole`: `remote_send`,
`remote_send_overlapped`, `deliver_window`, `abort`), the decode peers it writes to
(`peers`), its half of the Worker service (`service`) and its flags (`config`).
Imports engine, kvtransfer, proto and runtime; never decode or router.
"""
