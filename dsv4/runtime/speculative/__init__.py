"""Self-speculative decoding with the checkpoint's MTP block: `step` (the captured step's buffers
and segments, SpecStep), `verify` (accept, draft: the device-side decisions), `journal` (the
state rows a rejected row wrote, saved and put back), `policy` (when to speculate).
"""
