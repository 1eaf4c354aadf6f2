"""The decode role: reserve slots for a prompt's KV under a lease, wait for the prefill
node's notification, generate (`role.DecodeRole`: `prepare_receive`, `start_generation`,
`prepare_local`, `generate_local`, `abort`); leases, the quarantine of pages a late write
may still hit, the notification inbox; its half of the Worker service (`service`), the
conversions between messages and engine objects (`convert`) and its flags (`config`).
Imports engine, kvtransfer, proto and runtime; never prefill or router.
"""
