from freetoken_py.cli import main

if __name__ == "__main__":
    main()
