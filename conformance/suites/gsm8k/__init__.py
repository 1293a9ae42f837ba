"""Suite: GSM8K accuracy with intervals and paired tests (GPU), agreement across strategies (CPU twins)."""
