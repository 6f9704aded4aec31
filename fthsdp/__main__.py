from fthsdp.cli import main

main()
