"""`hopperlm eval`: held-out loss / perplexity (heldout.py) and GSM8K exact match of generated answers (gsm8k.py)."""
