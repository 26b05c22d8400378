"""Programs that run beside engines and routers (no Django): router client, agent, gateway,
fleet emulator."""
