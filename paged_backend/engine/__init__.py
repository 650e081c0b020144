"""Engine: request state, the synchronous step loop."""
