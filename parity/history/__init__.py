"""Production across its history: first-parent chains, throwaway worktrees, bisecting a verdict."""
