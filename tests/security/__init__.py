"""Security basics: no code from the wire, masked credentials, checked names, untrusted headers."""
