"""The order stage of the stream: which sample comes at each global position (epoch order, blend), which
positions a rank serves (split, elastic re-layout), and every seed, all pure functions of the config."""
