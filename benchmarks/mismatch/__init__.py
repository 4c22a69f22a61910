# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Where rollout and training disagree (CPU, tiny models): stale hints' flip rates, Qwen3.5's BF16 mismatch."""
