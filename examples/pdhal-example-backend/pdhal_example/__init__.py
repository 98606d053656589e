"""A template pdhal backend for a made-up accelerator, "example".

Its device is simulated in Python (a stream is a worker thread running queued work in
order) so the template runs anywhere and passes pdhal's conformance kit. Replace each piece
with your runtime's calls: see docs/writing-a-backend.md in pdhal.
"""
